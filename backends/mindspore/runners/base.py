"""The model runner's interface: the network on a fixed set of compiled shapes, turning a step plan into one
output per row. Two strategies implement it, chosen once by ``runners.build_runner``: ``PackedRunner`` (the
AOT kernels: one packed forward per step, packed.py) and ``SplitRunner`` (stock MindSpore ops: a prefill
call, then a decode call, split.py). The engine never asks which one it has.

Each strategy builds the network its model's family names (``families/``: ``Family.network``), and the network
completes its own graph inputs (``arguments``: adapter slots, or media rows and M-RoPE positions), so the runner
never asks which network it has.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar

import numpy as np
import mindspore as ms

from backends.mindspore.planning.device import free_network
from backends.mindspore.families import Family, family_of
from backends.mindspore.runners.kv_pages import CacheWarmer
from backends.mindspore.runners.launch import Launcher
from backends.mindspore.network.common import cache_memory
from backends.mindspore.modeldir.spec import ModelSpec
from backends.mindspore.planning.shapes import Shapes
from backends.mindspore.runners.step import DecodeRow, PrefillChunk, RowOutput, StepBatch
from backends.settings import EngineConfig

log = logging.getLogger("mindserve.engine")


def write_rows(slots: np.ndarray, kv_heads: int, num_slots: int) -> np.ndarray:
    """Cache rows of every new token's K/V heads, token-major: head h of slot s is row h * num_slots + s."""
    heads = np.arange(kv_heads, dtype=np.int64) * num_slots
    return (slots.reshape(-1, 1).astype(np.int64) + heads).reshape(-1).astype(np.int32)


# The prompt-logits head's rows per call: a compiled graph keeps its output buffer for its life, [rows, V] float32
# (Gemma 3's 262,144-token vocabulary: 1 MiB a row; a 64-row head held 47 MiB more than a 16-row one).
HEAD_ROWS = 16


class ModelRunner(ABC):
    """The network, its compiled shapes and graphs; subclasses say how a step's rows become graph calls."""

    kernels: ClassVar[str]  # "aot" | "stock": the kernel path, as /info reports it
    prefill_first: ClassVar[int]  # the scheduler's prefill-only steps in a row while prompts wait

    def __init__(self, spec: ModelSpec, weights: dict[str, np.ndarray], shapes: Shapes, num_blocks: int,
                 aot=None, dtype: str = "float32", lora: tuple[int, int] | None = None,
                 kv_dtype: str = "float32", window_blocks: int = 0) -> None:
        self.spec = spec
        # the sliding-window layers' own pool of blocks (engine/window_pool.py; 0: they keep full length)
        self.window_blocks = window_blocks
        self.shapes = shapes = self.compiled_shapes(shapes)
        self.dtype = dtype
        self.kv_dtype = kv_dtype  # the KV cache's format (kv_dtype.py): the stock-op path's is its dtype
        self.num_slots = num_blocks * shapes.block_size
        if spec.num_kv_heads * self.num_slots >= 2**31:
            raise ValueError(f"a KV cache of {num_blocks} blocks x {shapes.block_size} tokens x {spec.num_kv_heads} "
                             "kv heads has more rows than int32 indices address; lower cacheBlockNum")
        family = family_of(spec.arch)  # adapter slots only where the family has them (refused before, in preflight)
        assert lora is None or family.capabilities.lora, f"{spec.arch} takes no adapter slots"
        self.net = self.network(family, spec, weights, num_blocks, aot, dtype, lora)
        self.net.set_train(False)
        self._lora_host: dict[tuple[int, str, str], np.ndarray] = {}  # host copies of the slot arrays
        self._caches = cache_memory(self.net)  # each KV cache and a view of its memory
        memories = [memory for _, memory in self._caches if memory is not None]
        self.warmer = CacheWarmer(memories, self.num_slots, shapes.block_size,
                                  slots=[m.shape[0] // spec.num_kv_heads for m in memories])
        # maps the caches' pages once started (engine_parts: EngineConfig.map_kv_cache); warmup() waits for it
        self.head = self.net.lm_head()
        # the graph calls, each signature's compiled graph found once (launch.py)
        self.launch_net, self.launch_head = Launcher(self.net), Launcher(self.head)
        self.compiled: set[tuple] = set()
        # {"variant", "isa"} of the AOT kernels' build (the library aot_ops() loaded last), None on stock ops
        self.kernel_variant: dict[str, str] | None = None
        library = "stock"
        if aot is not None:
            from backends.mindspore.kernels import active_library, kernel_variant

            self.kernel_variant, library = kernel_variant(), active_library()
        # Everything of this runner that shapes its graphs (graph_cache.graph_key): the strategy, the compiled
        # shapes, the cache size, dtype, adapter slots, a vision model's spec, the kernel library (its file
        # name hashes its build) and the cache's format.
        self.graph_parts = [type(self).__name__, repr(shapes), str(self.num_slots), dtype, repr(lora),
                            repr(spec.vision), library, kv_dtype,
                            *([f"window pool {window_blocks}"] if window_blocks else []),
                            *(["layers stacked"] if getattr(self.net, "stack_layout", None) is not None else [])]

    # --- what a strategy defines ---

    def compiled_shapes(self, shapes: Shapes) -> Shapes:
        """The shapes this runner compiles, given the ones the settings allow (``shapes.plan_shapes``)."""
        return shapes

    @abstractmethod
    def network(self, family: Family, spec: ModelSpec, weights: dict[str, np.ndarray], num_blocks: int, aot,
                dtype: str, lora: tuple[int, int] | None):
        """The network cell of ``family`` on this strategy's kernels (its layer classes chosen there, once)."""

    @abstractmethod
    def prefill_budget(self, config: EngineConfig) -> int:
        """Prompt tokens the scheduler may plan per step."""

    def step_tokens(self) -> int:
        """The most tokens one step holds, decode and prompt together, that prompts may fill (0: no such
        limit; the scheduler keeps to ``prefill_budget``)."""
        return 0

    @abstractmethod
    def run(self, batch: StepBatch) -> Iterable[RowOutput]:
        """The forward passes of one step: one output per row of ``batch``, each as soon as it exists."""

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

    def draft_budget(self, decode_rows: int, prefill_rows: int) -> int:
        """Speculative draft tokens a step of ``decode_rows`` decode rows and ``prefill_rows`` prompt chunks may
        carry (speculative.py). This default, the stock-op split step's, is 0: it does not speculate."""
        return 0

    def fit_drafts(self, tokens: int, drafts: int) -> int:
        """Of ``drafts`` draft tokens wanted on a step of ``tokens`` tokens, how many are worth sending."""
        return drafts

    # --- shared ---

    def prefill(self, chunks: list[PrefillChunk]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One prompt chunk for each of several sequences: (last-token logits [n, V], hidden [t_i, D] each)."""
        return self._prefill(chunks)

    def decode(self, rows: list[DecodeRow]) -> np.ndarray:
        """One token for each row; logits [len(rows), V]."""
        return self._decode(rows)

    def decode_rows(self, batch: StepBatch) -> list[RowOutput]:
        """The decode call of the step's decode rows (one token each; rows 0..), with fault isolation."""
        return self.isolated(lambda r: (self.decode(r), [None] * len(r)), list(batch.decode), batch.decode_outputs())

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

    def _call(self, key: tuple, ids, pos, slots, table, last_rows, token_rows=None, lora_rows=None, chunks=(),
              places=(), hidden: bool = True):
        """One graph call: the strategy's inputs (``graph_inputs``), completed by the network itself
        (``arguments``: each token's adapter slot ``lora_rows``, -1 padding; a vision-language network's media
        rows of ``chunks``, chunk i's tokens from (row, column) ``places[i]``). (logits, hidden rows; None
        without ``hidden``: a decode step's are never read)."""
        args = self.net.arguments(self.graph_inputs(ids, pos, slots, table, last_rows, token_rows), lora_rows, chunks,
                                  places)
        started = time.perf_counter()
        logits, rows = self.launch_net(*args)
        out = logits.asnumpy(), rows.asnumpy() if hidden else None
        self._compiled(key, started)
        return out

    def _compiled(self, key: tuple, started: float) -> None:
        if key not in self.compiled:
            self.compiled.add(key)
            log.info("compiled graph %s in %.2fs", key, time.perf_counter() - started)

    def write_lora(self, slot: int, layer: int, group: str, a: np.ndarray, b: np.ndarray) -> None:
        """Put one adapter slot's factors of one layer's group into the network (lora_slots.LoraSlots)."""
        for part, value, param in zip("ab", (a, b), self.net.layers[layer].adapter_factors(group)):
            key = (layer, group, part)
            if key not in self._lora_host:
                self._lora_host[key] = param.asnumpy()
            host = self._lora_host[key]
            host[slot] = value
            param.set_data(ms.Tensor(host, param.dtype))

    def copy_cache_rows(self, source: int, block: int, rows: int) -> None:
        """Copy the first ``rows`` K/V rows of cache block ``source`` into block ``block``, every layer and kv
        head (the prefix cache's partial blocks, scheduler.py), through views of the caches' own memory
        (network/common.py's ``cache_memory``); where this MindSpore hands out a copy instead, the copy is
        written back whole (correct, slow). Not with a window pool (its caches are of another size; the
        scheduler lends no parts then)."""
        assert not self.window_blocks, "rows are not copied between blocks with a window pool"
        for param, memory in self._caches:
            host = param.asnumpy() if memory is None else memory
            self._spans(host, block, rows)[...] = self._spans(host, source, rows)
            if memory is None:
                param.set_data(ms.Tensor(host, param.dtype))

    def _spans(self, cache: np.ndarray, block: int, rows: int) -> np.ndarray:
        """The first ``rows`` rows of ``block`` in each kv head's part of ``cache`` (row h * slots + s), one
        element each: a copy of a few elements keeps the GIL, where NumPy's row-by-row copy let it go and
        waited up to the switch interval to get it back from the server's thread, once per layer (measured on
        the 1.7B shape, 16 clients: 70-150 ms a copy, against 2 ms)."""
        row = cache.strides[0]
        return np.ndarray((cache.shape[0] // self.num_slots,), np.dtype((np.void, rows * row)), buffer=cache,
                          offset=block * self.shapes.block_size * row, strides=(self.num_slots * row,))

    @property
    def head_rows(self) -> int:
        """Rows of one prompt-logits head call (its graph's shape)."""
        return min(HEAD_ROWS, self.shapes.prefill_chunk)

    def prompt_logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits [t, V] for normed hidden rows of one prefill chunk, ``head_rows`` at a time (the last call
        padded)."""
        rows, out = self.head_rows, []
        for at in range(0, len(hidden), rows):
            part = hidden[at:at + rows]
            padded = np.zeros((rows, hidden.shape[1]), np.float32)
            padded[: len(part)] = part
            started = time.perf_counter()
            out.append(self.launch_head(padded).asnumpy()[: len(part)])
            self._compiled(("head", rows), started)
        return np.concatenate(out) if len(out) != 1 else out[0]

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
        self.warmer.wait()

    def close(self) -> None:
        """Stop mapping cache pages (the engine is closing)."""
        self.warmer.stopped.set()

    def release(self) -> bool:
        """After ``close``, once no step runs: give the network's memory back (``device.free_network``), when the
        cache warmer's threads have stopped writing (False: they have not within 30 s; nothing was freed)."""
        if not self.warmer.join(30.0):
            log.warning("the KV cache's mapping threads did not stop: the closed network's memory is kept")
            return False
        free_network(self.net)
        return True
