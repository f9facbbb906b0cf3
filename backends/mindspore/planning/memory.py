"""The KV cache's memory budget (the reference server's ``npuMemSize``): the one home of the rule that sizes
the cache and caps the batch by what fits. The engine asks it before it loads the weights, ``validate-config``
and ``serve`` ask it before anything is loaded (``service/preflight.py``). No MindSpore import.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from backends.limits import longest_sequence
from backends.mindspore.planning.available import Available, available_memory  # noqa: F401 (this module's API)
from backends.mindspore.planning.kv_dtype import row_bytes
from backends.mindspore.planning.shapes import Shapes, plan_shapes
from backends.mindspore.planning.windows import window_blocks
from backends.settings import EngineConfig

if TYPE_CHECKING:
    from backends.mindspore.modeldir.spec import ModelSpec

GIB = 1 << 30
LOAD_COPIES = 2  # the weights are in memory twice while the network is built (NumPy arrays, then Parameters)
RUNTIME_RESERVE = 2 * GIB  # the MindSpore runtime and the compiled graphs (about 1 GB for configs/server.yaml)
MARGIN = 0.2  # of the available memory, left to everything else on the machine (npuMemSize -1)


class MemoryBudgetError(ValueError):
    """The cache the settings ask for does not fit; the message names the keys to change."""


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one model costs in memory: its weights as loaded (a vision-language checkpoint: both towers), the
    K/V bytes of one token, and the vision tower's largest call (0 for a text model)."""

    weights_bytes: int
    bytes_per_token: int  # K and V, every layer, in the cache's format
    activation_bytes: int = 0
    graphs: StockGraphs | None = None  # the stock-op path's per-graph activations (None: the AOT path's are small)
    load_bytes: int = 0  # the peak while the network is built; 0: LOAD_COPIES x weights_bytes
    kv_dtype: str = "float32"  # the cache's format (kv_dtype.py), for the log line
    window: int = 0  # the sliding window of the layers in the window pool (engine/window_pool.py); 0: none
    window_bytes_per_token: int = 0  # their K and V of one token (not in bytes_per_token)

    @classmethod
    def of(cls, spec: ModelSpec, extra_bytes: int = 0, stock: bool = False, kv_dtype: str = "float32") -> Footprint:
        """``extra_bytes``: what the network holds besides the checkpoint (the LoRA adapter slots); ``stock``: the
        network runs on stock MindSpore ops, which hold quantized weights as float32 copies (the tied output
        matrix a copy of its own) and keep every compiled graph's activations. While that network is built the
        checkpoint as read is held beside it: the GGUF blocks of a quantized one, the float32 arrays of another
        (measured at SmolLM2-1.7B's shape, Q4_1: 8.8 GiB peak, not twice the 6.7 GiB of float32 weights).
        ``kv_dtype``: the cache's format (``kv_dtype.cache_dtype``; off CPU the stock path's cache may be in a
        smaller compute dtype: the budget errs safe)."""
        layer = 2 * spec.num_kv_heads * row_bytes(kv_dtype, spec.head_dim)
        kv = spec.num_layers * layer
        if not stock:  # the AOT path keeps a sliding-window layer's K/V in the window pool
            sliding = getattr(spec, "gemma3", None)
            local = sum(sliding.sliding_layers) if sliding is not None else 0
            return cls(weights_bytes(spec.checkpoint, tied=spec.tie_word_embeddings) + extra_bytes, kv - local * layer,
                       _vision_activations(spec), kv_dtype=kv_dtype, window=sliding.sliding_window if local else 0,
                       window_bytes_per_token=local * layer)
        held = weights_bytes(spec.checkpoint, dequantized=True) + extra_bytes
        if spec.tie_word_embeddings:
            held += embedding_bytes(spec.checkpoint)
        return cls(held, kv, _vision_activations(spec), StockGraphs.of(spec),
                   load_bytes=held + weights_bytes(spec.checkpoint, as_read=True), kv_dtype=kv_dtype)

    def plus(self, draft: Footprint) -> Footprint:
        """This model's footprint with a draft model's (speculative decoding) beside it: both weights, and a
        cache block holds both models' K/V (the draft cache has as many blocks)."""
        return replace(self, weights_bytes=self.weights_bytes + draft.weights_bytes,
                       # the draft's sliding-window layers (if any) keep full length: no window pool of their own
                       bytes_per_token=self.bytes_per_token + draft.bytes_per_token + draft.window_bytes_per_token,
                       load_bytes=self.load_bytes and self.load_bytes + draft.load_peak)

    @property
    def load_peak(self) -> int:
        return self.load_bytes or LOAD_COPIES * self.weights_bytes


# What one stock-op graph keeps (MindSpore CPU, GRAPH mode: a compiled graph holds its intermediates between calls,
# and RSS grows by each graph's own): per layer, SCORE_COPIES tensors of attention scores [B, H, T, W] and
# TOKEN_COPIES of every token's activations (qkv, 2 x FFN, 4 x hidden), plus GRAPH_FIXED. Calibrated on
# SmolLM2-135M's served config (docs/performance.md, "The stock-op path's memory"): measured 59-3300 MiB per graph,
# this gives 5-40% more.
SCORE_COPIES = 4
TOKEN_COPIES = 3
GRAPH_FIXED = 96 << 20


@dataclass(frozen=True, slots=True)
class StockGraphs:
    """The model dimensions the stock-op graphs' activations follow."""

    layers: int
    heads: int
    token_floats: int  # per token and layer: qkv + 2 x FFN + 4 x hidden
    vocab: int

    @classmethod
    def of(cls, spec: ModelSpec) -> StockGraphs:
        qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        ffn = 2 * spec.intermediate_size
        moe = getattr(spec, "moe", None)
        if moe is not None:  # the stock ops run every expert on every token: [E, N, 2F + F + C]
            ffn = max(ffn, moe.num_experts * (3 * moe.intermediate_size + spec.hidden_size))
        return cls(spec.num_layers, spec.num_heads, qkv + ffn + 4 * spec.hidden_size, spec.vocab_size)

    def graph_bytes(self, batch: int, tokens: int, window: int) -> int:
        """One graph: ``batch`` rows of ``tokens`` tokens over ``window`` keys."""
        scores = self.layers * batch * self.heads * tokens * window * 4
        activations = self.layers * batch * tokens * self.token_floats * 4
        return GRAPH_FIXED + SCORE_COPIES * scores + TOKEN_COPIES * activations + batch * self.vocab * 4

    def total(self, shapes: Shapes) -> int:
        """Every graph the split runner compiles for ``shapes`` (split.py's warm-up plan: prefill per prefill
        batch and window, decode per batch and window)."""
        prefill = sum(self.graph_bytes(b, shapes.prefill_chunk, w)
                      for b in shapes.prefill_batch_buckets for w in shapes.window_buckets)
        return prefill + sum(self.graph_bytes(b, 1, w) for b in shapes.batch_buckets for w in shapes.window_buckets)


@dataclass(frozen=True, slots=True)
class CachePlan:
    """The cache chosen: its blocks, the batch they hold, and why."""

    num_blocks: int  # including the scratch block
    max_batch_size: int
    asked_batch_size: int
    cache_bytes: int
    budget: str  # how the budget was set, for the log line
    kv_dtype: str = "float32"  # the cache's format (kvCacheDtype)
    max_prefill_batch: int | None = None  # set when the stock-op graphs' activations capped maxPrefillBatchSize
    asked_prefill_batch: int | None = None
    window_blocks: int = 0  # the window pool's blocks, including its scratch block (0: no window pool)

    @property
    def capped(self) -> bool:
        return self.max_batch_size < self.asked_batch_size

    @property
    def prefill_capped(self) -> bool:
        return self.max_prefill_batch is not None and self.max_prefill_batch < (self.asked_prefill_batch or 0)

    def apply(self, config: EngineConfig) -> EngineConfig:
        """``config`` with this cache and, when capped, the batch (and the buckets above it) brought down."""
        if self.prefill_capped:
            p = self.max_prefill_batch
            config = replace(config, max_prefill_batch=p, prefill_batch_buckets=_trim(config.prefill_batch_buckets, p))
        if not self.capped:
            return replace(config, num_blocks=self.num_blocks)
        b = self.max_batch_size
        return replace(config, num_blocks=self.num_blocks, max_batch_size=b,
                       max_prefill_batch=min(config.max_prefill_batch, b),
                       batch_buckets=_trim(config.batch_buckets, b),
                       prefill_batch_buckets=_trim(config.prefill_batch_buckets, b))

    def describe(self) -> str:
        """The one log line saying what was chosen and why."""
        chosen = (f"maxBatchSize capped from {self.asked_batch_size} to {self.max_batch_size} (what fits)"
                  if self.capped else f"maxBatchSize {self.max_batch_size} fits")
        if self.prefill_capped:
            chosen += (f"; maxPrefillBatchSize capped from {self.asked_prefill_batch} to {self.max_prefill_batch} "
                       "(the stock-op graphs' activations)")
        pool = f" + {self.window_blocks} sliding-window blocks" if self.window_blocks else ""
        return (f"KV cache: {self.num_blocks} blocks{pool}, {_gib(self.cache_bytes)} ({self.kv_dtype}); {chosen}; "
                f"budget {self.budget}")


def plan_cache(config: EngineConfig, model: Footprint, available: Available,
               max_positions: int | None = None) -> CachePlan:
    """The cache for ``config``: enough blocks for maxBatchSize longest sequences (+ the scratch block)
    within the budget (npuMemSize GB, or -1: ``available`` less the weights, the runtime reserve, the stock-op
    graphs' activations and the margin), the batch capped at what the budget holds. On the stock-op path the
    prefill batch is capped first, halving it until maxBatchSize sequences fit beside its graphs (or it is 1).
    A set ``num_blocks`` (Python API) is taken as it is. Raises MemoryBudgetError naming the keys when not even
    one sequence fits."""
    if config.num_blocks:
        asked = config.max_batch_size
        per_window = _window_blocks(config, model, max_positions)
        pool = min(config.num_blocks, 1 + asked * per_window) if per_window else 0
        full = model.bytes_per_token + (0 if pool else model.window_bytes_per_token)
        cache = config.block_size * (config.num_blocks * full + pool * model.window_bytes_per_token)
        return CachePlan(config.num_blocks, asked, asked, cache, "num_blocks (set)", kv_dtype=model.kv_dtype,
                         window_blocks=pool)
    if model.graphs is None:
        return _plan(config, model, available, max_positions, 0)
    prefill = config.max_prefill_batch
    while True:
        trial = replace(config, max_prefill_batch=prefill,
                        prefill_batch_buckets=_trim(config.prefill_batch_buckets, prefill))
        graphs = model.graphs.total(plan_shapes(trial, max_positions))
        try:
            plan = _plan(trial, model, available, max_positions, graphs)
        except MemoryBudgetError:
            if prefill == 1:
                raise
            prefill = max(1, prefill // 2)
            continue
        if plan.capped and prefill > 1:
            prefill = max(1, prefill // 2)
            continue
        return replace(plan, max_prefill_batch=prefill, asked_prefill_batch=config.max_prefill_batch)


def _window_blocks(config: EngineConfig, model: Footprint, max_positions: int | None) -> int:
    """Window-pool blocks a sequence reserves (0: no pool: not asked for (``window_pool``), no sliding-window
    layers, or a window that covers the longest sequence)."""
    if not model.window or not config.window_pool:
        return 0
    return window_blocks(model.window, config, longest_sequence(config, max_positions))


def _plan(config: EngineConfig, model: Footprint, available: Available, max_positions: int | None,
          graph_bytes: int) -> CachePlan:
    per_window = _window_blocks(config, model, max_positions)
    # a full-length block, and as many window blocks as a sequence reserves for each of its full-length blocks
    window_bytes = model.window_bytes_per_token if per_window else 0
    longest = longest_sequence(config, max_positions)
    per_sequence = -(-longest // config.block_size)
    block_bytes = config.block_size * (model.bytes_per_token + (0 if per_window else model.window_bytes_per_token))
    sequence_bytes = per_sequence * block_bytes + per_window * config.block_size * window_bytes
    scratch_bytes = block_bytes + (config.block_size * window_bytes if per_window else 0)
    asked = config.max_batch_size
    # The checkpoint as read is held beside the network only while it is built; the graphs' activations come after.
    held = max(model.load_peak, model.weights_bytes + graph_bytes)
    fixed = held + RUNTIME_RESERVE + model.activation_bytes
    weights = _weights_text(model, config, graph_bytes)
    if config.cache_gb > 0:
        budget = int(config.cache_gb * GIB)
        budget_text = f"npuMemSize {config.cache_gb:g} GB"
    else:
        margin = int(MARGIN * available.bytes)
        budget = available.bytes - fixed - margin
        vision = f" - vision tower {_gib(model.activation_bytes)}" if model.activation_bytes else ""
        budget_text = (f"npuMemSize -1: {_gib(available.bytes)} available ({available.source}) - {weights} - "
                       f"runtime reserve {_gib(RUNTIME_RESERVE)}{vision} - margin {MARGIN:.0%} = "
                       f"{_gib(max(budget, 0))}")
    sequences = max(budget - scratch_bytes, 0) // sequence_bytes
    if sequences < 1 and config.cache_gb <= 0 and fixed + margin >= available.bytes:
        raise MemoryBudgetError(
            f"the model does not fit before any KV cache: {budget_text}"
            + ("; lower maxPrefillBatchSize or the windowBuckets, or set kernels: aot (stock ops hold every "
               "matrix as float32)" if graph_bytes else "") + ", or free memory")
    if sequences < 1:
        raise MemoryBudgetError(
            f"the KV cache does not hold one sequence: {_sequence(config, longest)} in blocks of cacheBlockSize "
            f"{config.block_size} needs {per_sequence} blocks + 1 scratch = {_gib(sequence_bytes + scratch_bytes)}, "
            f"and the budget is {budget_text}; lower maxSeqLen"
            + (", maxPrefillBatchSize or the windowBuckets" if graph_bytes else "")
            + ", or raise npuMemSize" + ("" if config.cache_gb > 0 else " (set it in GB) or free memory"))
    batch = min(asked, sequences)
    plan = CachePlan(batch * per_sequence + 1, batch, asked, batch * sequence_bytes + scratch_bytes, budget_text,
                     kv_dtype=model.kv_dtype, window_blocks=batch * per_window + 1 if per_window else 0)
    if config.cache_gb > 0 and plan.cache_bytes + fixed > available.bytes:
        raise MemoryBudgetError(
            f"npuMemSize {config.cache_gb:g} GB: the cache of {plan.num_blocks} blocks ({_gib(plan.cache_bytes)}, "
            f"maxBatchSize {batch} x {_sequence(config, longest)}) with the {weights} and the runtime reserve "
            f"({_gib(RUNTIME_RESERVE)}) needs more than the {_gib(available.bytes)} available ({available.source}); "
            "lower npuMemSize, maxBatchSize or maxSeqLen, or set npuMemSize -1 to size the cache from what is free")
    return plan


def _weights_text(model: Footprint, config: EngineConfig, graph_bytes: int) -> str:
    """The weights' term of the budget line."""
    load = (f"weights {_gib(model.weights_bytes)} + checkpoint {_gib(model.load_bytes - model.weights_bytes)} while "
            "loading" if model.load_bytes else f"weights {_gib(model.weights_bytes)} x {LOAD_COPIES}")
    if not graph_bytes:
        return load
    return (f"max({load}, weights + stock-op graphs {_gib(graph_bytes)} (maxPrefillBatchSize "
            f"{config.max_prefill_batch}, batchBuckets, windowBuckets))")


def _vision_activations(spec: ModelSpec) -> int:
    """The vision tower's largest call of a vision-language model (its family's reader estimated it), 0 for a text
    model."""
    return spec.vision.tower_bytes if spec.vision is not None else 0


def weights_bytes(checkpoint: Path, dequantized: bool = False, as_read: bool = False, tied: bool = False) -> int:
    """Bytes of the weights once loaded (float32, or GGUF blocks as they are; ``dequantized``: every quantized
    tensor as float32, as the stock-op path holds it; ``as_read``: the arrays the loader returns, blocks without
    the embedding's lookup table; ``tied``: the model ties its head to the embedding, whose rows the AOT networks
    then read from the packed head when ``quant.embedding_in_head`` says so, holding no table): from the
    safetensors headers (a file, or every ``*.safetensors`` of a directory), else the file size. Reads no tensor
    data."""
    files = sorted(checkpoint.glob("*.safetensors")) if checkpoint.is_dir() else [checkpoint]
    return sum(_safetensors_bytes(f, dequantized, as_read, tied=tied) if f.suffix == ".safetensors"
               else f.stat().st_size for f in files)


def embedding_bytes(checkpoint: Path) -> int:
    """The input embedding as float32 (what a tied output matrix costs on the stock-op path), 0 if not found."""
    files = sorted(checkpoint.glob("*.safetensors")) if checkpoint.is_dir() else [checkpoint]
    return sum(_safetensors_bytes(f, dequantized=True, only=EMBEDDING) for f in files if f.suffix == ".safetensors")


EMBEDDING = "model.embed_tokens.weight"


def _safetensors_bytes(path: Path, dequantized: bool = False, as_read: bool = False, only: str | None = None,
                       tied: bool = False) -> int:
    """Bytes of every tensor a safetensors file holds once loaded (its header: u64 length, then JSON): float32
    for the float tensors; the GGUF blocks of a quantized conversion (its metadata key mindserve.quantization)
    as they are (the kernels' packed copy is the same size), plus a float32 lookup table for a quantized
    embedding. The file size when the header does not parse (loading the weights then says what is wrong)."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        from backends.mindspore.modeldir.quant import QUANT_KEY

        quantized = json.loads((header.get("__metadata__") or {}).get(QUANT_KEY) or "{}")
        return sum(_tensor_bytes(name, t, quantized.get(name), dequantized, as_read, tied) for name, t in header.items()
                   if name != "__metadata__" and only in (None, name))
    except (ValueError, struct.error, KeyError, TypeError, AttributeError):
        return 0 if only else path.stat().st_size


def _tensor_bytes(name: str, tensor: dict, fmt: str | None, dequantized: bool = False, as_read: bool = False,
                  tied: bool = False) -> int:
    from backends.mindspore.modeldir.quant import cols_of, embedding_in_head

    count = math.prod(tensor["shape"])
    if fmt is None or tensor.get("dtype") != "U8":
        return count * 4
    rows, row_bytes = tensor["shape"]
    floats = rows * cols_of(fmt, row_bytes) * 4
    if dequantized:
        return floats
    table = name == EMBEDDING and not as_read and not embedding_in_head(tied, fmt)
    return count + (floats if table else 0)


def _sequence(config: EngineConfig, longest: int) -> str:
    if longest == config.max_seq_len:
        return f"maxSeqLen {longest} tokens"
    return f"{longest} tokens (maxSeqLen {config.max_seq_len}, capped by the model's max_position_embeddings)"


def _trim(buckets: tuple[int, ...] | None, largest: int) -> tuple[int, ...] | None:
    """``buckets`` without those above ``largest`` (which becomes the largest)."""
    if buckets is None or max(buckets) <= largest:
        return buckets
    return (*(b for b in sorted(buckets) if b < largest), largest)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.1f} MiB"
