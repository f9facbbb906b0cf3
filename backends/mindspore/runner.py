"""The model runner: the network on a fixed set of compiled shapes, turning a step plan into one output per
row. Two strategies behind one interface, chosen once by ``build_runner``: ``PackedRunner`` (the AOT
kernels: one packed forward per step, packed.py) and ``SplitRunner`` (stock MindSpore ops: a prefill call,
then a decode call, split.py). The engine never asks which one it has.

The network is ``LlamaModel``, or for a vision-language model (``vl``) ``Qwen2VLText``: then every call also
takes media rows, their mask and M-RoPE positions (``media_inputs``; text-only rows: zeros and plain positions
on all three streams), so image and text requests share one graph.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import mindspore as ms

from backends.mindspore.kernel_path import KERNELS, fits_aot
from backends.mindspore.config import ModelSpec
from backends.mindspore.model import LlamaModel, LMHead
from backends.mindspore.scheduler import StepPlan
from backends.mindspore.sequence import SeqState
from backends.mindspore.shapes import Shapes
from backends.settings import EngineConfig

log = logging.getLogger("mindserve.engine")


@dataclass(slots=True)
class PrefillChunk:
    ids: list[int]  # this chunk's prompt tokens
    start: int  # position of ids[0]
    blocks: list[int]
    lora: int = -1  # adapter slot (-1: the base model)
    media: tuple[np.ndarray, np.ndarray] | None = None  # vision rows [t, D] and their mask [t]; None: text
    mpos: np.ndarray | None = None  # M-RoPE positions [3, t]; None: cache index + delta on all three
    delta: int = 0


@dataclass(slots=True)
class DecodeRow:
    token: int
    position: int
    blocks: list[int]
    lora: int = -1  # adapter slot (-1: the base model)
    delta: int = 0  # M-RoPE: the token's position is its cache index + delta


def media_inputs(chunks: list[PrefillChunk], places: list[tuple[int, int]], pos: np.ndarray,
                 dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A vision-language network's extra inputs for tokens laid out as ``pos`` [B, T], chunk i's tokens from
    (row, column) ``places[i]``: media rows [B, T, D], mask [B, T, 1] and M-RoPE positions [3, B, T]
    (padding and text: the cache index, plus each chunk's delta)."""
    b, t = pos.shape
    media, mask = np.zeros((b, t, dim), np.float32), np.zeros((b, t, 1), np.float32)
    mpos = np.broadcast_to(pos, (3, b, t)).astype(np.int32)
    for c, (row, at) in zip(chunks, places):
        n = len(c.ids)
        if c.mpos is not None:
            mpos[:, row, at:at + n] = c.mpos
        elif c.delta:
            mpos[:, row, at:at + n] += c.delta
        if c.media is not None:
            media[row, at:at + n], mask[row, at:at + n, 0] = c.media
    return media, mask, mpos


@dataclass(slots=True)
class RowOutput:
    """What one row of a step gave: the logits of its last token, or the error that failed it."""

    seq: SeqState
    prompt: PrefillChunk | None = None  # the prompt chunk this row ran; None: a decode row
    logits: np.ndarray | None = None  # [V]
    hidden: np.ndarray | None = None  # [t, D] final-normed hidden rows of the prompt chunk
    error: Exception | None = None


def write_rows(slots: np.ndarray, kv_heads: int, num_slots: int) -> np.ndarray:
    """Cache rows of every new token's K/V heads, token-major: head h of slot s is row h * num_slots + s."""
    heads = np.arange(kv_heads, dtype=np.int64) * num_slots
    return (slots.reshape(-1, 1).astype(np.int64) + heads).reshape(-1).astype(np.int32)


class ModelRunner(ABC):
    """The network, its compiled shapes and graphs; subclasses say how a step's rows become graph calls."""

    kernels: ClassVar[str]  # "aot" | "ms": the kernel path, as /info reports it
    prefill_first: ClassVar[int]  # the scheduler's prefill-only steps in a row while prompts wait

    def __init__(self, spec: ModelSpec, weights: dict[str, np.ndarray], shapes: Shapes, num_blocks: int,
                 aot=None, dtype: str = "float32", lora: tuple[int, int] | None = None, vl=None) -> None:
        self.spec = spec
        self.shapes = shapes = self.compiled_shapes(shapes)
        self.dtype = dtype
        self.num_slots = num_blocks * shapes.block_size
        if spec.num_kv_heads * self.num_slots >= 2**31:
            raise ValueError(f"a KV cache of {num_blocks} blocks x {shapes.block_size} tokens x {spec.num_kv_heads} "
                             "kv heads has more rows than int32 indices address; lower cacheBlockNum")
        self.vl = vl is not None  # a Qwen2-VL language model (``vl`` its VLSpec): media inputs on every call
        if self.vl:
            from backends.mindspore.qwen2_vl.text import Qwen2VLText

            if lora is not None or dtype != "float32":
                raise ValueError("a vision-language model runs in float32 without LoRA adapter slots")
            self.net = Qwen2VLText(vl, weights, num_blocks, shapes.block_size, shapes.max_window, aot)
        else:
            self.net = LlamaModel(spec, weights, num_blocks, shapes.block_size, shapes.max_window, aot, dtype, lora)
        self.net.set_train(False)
        self.lora = lora  # (slots, rank) of the adapter slots, None without adapters
        self._lora_host: dict[tuple[int, str, str], np.ndarray] = {}  # host copies of the slot arrays
        self.head = LMHead(self.net)
        self.compiled: set[tuple] = set()
        # {"variant", "isa"} of the AOT kernels' build (the library aot_ops() loaded last), None on stock ops
        self.kernel_variant: dict[str, str] | None = None
        if aot is not None:
            from backends.mindspore.kernels import kernel_variant

            self.kernel_variant = kernel_variant()

    # --- what a strategy defines ---

    def compiled_shapes(self, shapes: Shapes) -> Shapes:
        """The shapes this runner compiles, given the ones the settings allow (``shapes.plan_shapes``)."""
        return shapes

    @abstractmethod
    def prefill_budget(self, config: EngineConfig) -> int:
        """Prompt tokens the scheduler may plan per step."""

    @abstractmethod
    def run(self, plan: StepPlan) -> Iterable[RowOutput]:
        """The forward passes of one step: one output per planned row, each as soon as it exists."""

    @abstractmethod
    def _prefill(self, chunks: list[PrefillChunk]) -> tuple[np.ndarray, list[np.ndarray]]:
        """``prefill`` for this strategy."""

    @abstractmethod
    def _decode(self, rows: list[DecodeRow]) -> np.ndarray:
        """``decode`` for this strategy."""

    @abstractmethod
    def warmup_plan(self) -> list[tuple]:
        """The key of every graph the engine will call, the prompt-logits head last."""

    @abstractmethod
    def _warm(self, key: tuple) -> None:
        """Call the graph of ``key`` once, on the scratch block only."""

    @abstractmethod
    def graph_inputs(self, ids, pos, slots, table, last_rows, token_rows=None) -> tuple:
        """The network's inputs (numpy) for padded ids/pos/slots, a block table and the logit rows."""

    # --- shared ---

    def prefill(self, chunks: list[PrefillChunk]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One prompt chunk for each of several sequences: (last-token logits [n, V], hidden [t_i, D] each)."""
        return self._prefill(chunks)

    def decode(self, rows: list[DecodeRow]) -> np.ndarray:
        """One token for each row; logits [len(rows), V]."""
        return self._decode(rows)

    def decode_rows(self, plan: StepPlan) -> list[RowOutput]:
        """The decode call of the plan's running sequences (one token each), with fault isolation."""
        rows = [DecodeRow(s.generated[-1], s.length - 1, s.blocks, s.lora_slot, s.delta) for s in plan.decode]
        return self.isolated(lambda r: (self.decode(r), [None] * len(r)), rows, [RowOutput(s) for s in plan.decode])

    @staticmethod
    def prompt_chunks(plan: StepPlan) -> list[PrefillChunk]:
        """The next prompt tokens of each planned sequence, from ``seq.prefilled`` on: a prompt that shares
        cached prefix blocks starts after them, and its block table still lists them, so attention reads them."""
        return [PrefillChunk(seq.prompt_ids[seq.prefilled:seq.prefilled + n], seq.prefilled, seq.blocks,
                             seq.lora_slot, seq.chunk_media(seq.prefilled, seq.prefilled + n),
                             seq.chunk_positions(seq.prefilled, seq.prefilled + n), seq.delta)
                for seq, n in plan.prefill]

    @staticmethod
    def isolated(forward: Callable[[list], tuple[np.ndarray, list]], rows: list,
                 outs: list[RowOutput]) -> list[RowOutput]:
        """Fill ``outs`` from ``forward(rows)``; if it fails, rerun each row alone so only the culprit fails.

        Rerunning is safe: a row rewrites the same cache slots with the same values.
        """
        try:
            logits, hidden = forward(rows)
            for out, row_logits, row_hidden in zip(outs, logits, hidden):
                out.logits, out.hidden = row_logits, row_hidden
            return outs
        except Exception as exc:
            if len(rows) == 1:
                outs[0].error = exc
                return outs
            log.warning("batched forward of %d rows failed (%s); isolating rows", len(rows), exc)
        for row, out in zip(rows, outs):
            try:
                logits, hidden = forward([row])
                out.logits, out.hidden = logits[0], hidden[0]
            except Exception as exc:
                out.error = exc
        return outs

    def _call(self, key: tuple, ids, pos, slots, table, last_rows, token_rows=None, lora_rows=None, media=None):
        """One graph call; ``lora_rows`` (each token's adapter slot, -1 padding) is an input only when the
        network has adapter slots; ``media`` (``media_inputs``) only for a vision-language network."""
        args = self.graph_inputs(ids, pos, slots, table, last_rows, token_rows)
        if self.vl:
            args = (args[0], *media, *args[1:])
        if self.lora is not None:
            args = (*args, np.ascontiguousarray(lora_rows, np.int32))
        started = time.perf_counter()
        logits, hidden = self.net(*(None if a is None else ms.Tensor(a) for a in args))
        out = logits.asnumpy(), hidden.asnumpy()
        self._compiled(key, started)
        return out

    def _compiled(self, key: tuple, started: float) -> None:
        if key not in self.compiled:
            self.compiled.add(key)
            log.info("compiled graph %s in %.2fs", key, time.perf_counter() - started)

    def write_lora(self, slot: int, layer: int, group: str, a: np.ndarray, b: np.ndarray) -> None:
        """Put one adapter slot's factors of one layer's group into the network (lora_slots.LoraSlots)."""
        cell = self.net.layers[layer]
        for part, value in (("a", a), ("b", b)):
            param = getattr(cell, f"lora_{group}_{part}")
            key = (layer, group, part)
            if key not in self._lora_host:
                self._lora_host[key] = param.asnumpy()
            host = self._lora_host[key]
            host[slot] = value
            param.set_data(ms.Tensor(host, param.dtype))

    def prompt_logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits [t, V] for normed hidden rows of one prefill chunk (padded to the chunk shape)."""
        padded = np.zeros((self.shapes.prefill_chunk, hidden.shape[1]), np.float32)
        padded[: len(hidden)] = hidden
        started = time.perf_counter()
        out = self.head(ms.Tensor(padded)).asnumpy()[: len(hidden)]
        self._compiled(("head", self.shapes.prefill_chunk), started)
        return out

    def graph_parts(self) -> list[str]:
        """Everything of this runner that shapes its graphs (graph_cache.graph_key): the strategy, the compiled
        shapes, the cache size, dtype, adapter slots and the kernel library (its file name hashes its build)."""
        from backends.mindspore.kernels import active_library

        return [type(self).__name__, repr(self.shapes), str(self.num_slots), self.dtype, repr(self.lora),
                repr(self.vl), active_library() if self.kernel_variant else "stock"]

    def warmup(self, progress: bool = False) -> None:
        """Compile every graph shape the engine will use; only the scratch block is written."""
        from tqdm import tqdm

        plan = self.warmup_plan()
        started = time.perf_counter()
        for key in tqdm(plan, desc="warm-up: compiling graphs", disable=not progress, unit="graph"):
            if key[0] == "head":
                self.prompt_logits(np.zeros((1, self.spec.hidden_size), np.float32))
            else:
                self._warm(key)
        log.info("warm-up done: %d graphs in %.1fs", len(plan), time.perf_counter() - started)


def _aot_ops(spec: ModelSpec, kernel_isa: str = "auto"):
    """The AOT kernels (an ``AotOps``) of the build variant ``kernel_isa`` asks for (``auto``: the best this CPU
    runs, or $MINDSERVE_KERNEL_ISA), or None with a warning where they cannot be built or do not fit the model.
    A named variant this CPU cannot run is a ValueError naming the key."""
    from backends.mindspore.kernels import KernelBuildError, aot_ops, choose_variant

    if not fits_aot(spec):
        log.warning("AOT kernels do not support head_dim %d with %d heads / %d kv heads; using stock MindSpore "
                    "ops", spec.head_dim, spec.num_heads, spec.num_kv_heads)
        return None
    requested = None if kernel_isa == "auto" else kernel_isa
    try:
        variant = choose_variant(requested).name
    except KernelBuildError as exc:
        key = "BackendConfig.ModelDeployConfig.kernelIsa" if requested else "the environment's MINDSERVE_KERNEL_ISA"
        raise ValueError(f"{key}: {exc}") from None
    try:
        ops = aot_ops(spec.num_heads, spec.num_kv_heads, spec.head_dim, variant=variant)
    except KernelBuildError as exc:
        log.warning("AOT kernels unavailable, using stock MindSpore ops: %s", exc)
        return None
    return ops


def choose_kernels(spec: ModelSpec, kernels: str = "ms", device: str = "CPU", kernel_isa: str = "auto"):
    """The AOT operators the runner will use (an ``AotOps``), or None for the stock-op path: decided once, before
    the memory budget (the stock path holds float32 weights and every compiled graph's activations)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if device != "CPU":
        if kernels == "aot":
            raise ValueError(f"kernels 'aot' asked for, but the AOT kernels are CPU kernels and the model's "
                             f"context.device_target is {device}")
        return None
    aot = _aot_ops(spec, kernel_isa) if kernels != "ms" else None
    if kernels == "aot" and aot is None:
        raise RuntimeError("kernels 'aot' asked for, but the AOT kernels could not be built (see the log)")
    return aot


def build_runner(spec: ModelSpec, weights: dict[str, np.ndarray], shapes: Shapes, num_blocks: int,
                 kernels: str = "ms", device: str = "CPU", lora: tuple[int, int] | None = None,
                 vl=None, kernel_isa: str = "auto", aot=False) -> ModelRunner:
    """The runner for ``kernels`` (auto|aot|ms) on ``device``: on CPU the AOT kernels where asked and they
    build (float32); elsewhere the stock ops in the yaml's compute_dtype (float32 for a vision-language
    model, ``vl`` its VLSpec). ``aot``: the operators ``choose_kernels`` already chose (None: stock ops)."""
    from backends.mindspore.packed import PackedRunner
    from backends.mindspore.split import SplitRunner

    if aot is False:
        aot = choose_kernels(spec, kernels, device, kernel_isa)
    if aot is None:
        dtype = spec.compute_dtype if device != "CPU" and vl is None else "float32"
        runner: ModelRunner = SplitRunner(spec, weights, shapes, num_blocks, dtype=dtype, lora=lora, vl=vl)
    else:
        runner = PackedRunner(spec, weights, shapes, num_blocks, aot, lora=lora, vl=vl)
    variant = f" [variant {runner.kernel_variant['variant']}, {runner.kernel_variant['isa']} vectors]" \
        if runner.kernel_variant else ""
    log.info("kernels: %s%s on %s, %s", runner.description, variant, device, runner.dtype)
    return runner
