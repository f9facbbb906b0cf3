"""Runs the network on a fixed set of shapes: builds padded inputs, picks buckets, warms every graph up."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import mindspore as ms

from backends.mindspore.config import ModelSpec
from backends.mindspore.kv_cache import block_table, token_slots
from backends.mindspore.model import LlamaModel, LMHead

log = logging.getLogger("mindserve.engine")
_NEG = np.float32(-1e9)


@dataclass(frozen=True, slots=True)
class Shapes:
    """The static shapes the graphs are compiled for."""

    block_size: int
    prefill_chunk: int
    batch_buckets: tuple[int, ...]  # decode batch sizes, ascending
    window_buckets: tuple[int, ...]  # attention windows (tokens), ascending multiples of block_size
    prefill_batch_buckets: tuple[int, ...] = (1,)  # sequences prefilled together, ascending
    prefill_sizes: tuple[int, ...] = ()  # packed prefill: token counts compiled, ascending (default: the chunk)

    def __post_init__(self) -> None:
        if any(w % self.block_size for w in self.window_buckets):
            raise ValueError(f"window buckets {self.window_buckets} must be multiples of {self.block_size}")
        for buckets in (self.batch_buckets, self.window_buckets, self.prefill_batch_buckets):
            if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
                raise ValueError(f"buckets {buckets} must be positive and strictly ascending")

    @property
    def max_window(self) -> int:
        return self.window_buckets[-1]

    def window_for(self, tokens: int) -> int:
        for w in self.window_buckets:
            if w >= tokens:
                return w
        raise ValueError(f"{tokens} tokens exceed the largest attention window {self.max_window}")

    def batch_for(self, rows: int, prefill: bool = False) -> int:
        buckets = self.prefill_batch_buckets if prefill else self.batch_buckets
        for b in buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest batch {buckets[-1]}")


@dataclass(slots=True)
class PrefillChunk:
    ids: list[int]  # this chunk's prompt tokens
    start: int  # position of ids[0]
    blocks: list[int]


@dataclass(slots=True)
class DecodeRow:
    token: int
    position: int
    blocks: list[int]


def _mask(pos: np.ndarray, window: int) -> np.ndarray:
    """Additive attention mask [B, 1, T, W]: key j is visible to the token at position p iff j <= p."""
    visible = np.arange(window)[None, None, :] <= pos[:, :, None]
    return np.where(visible, np.float32(0), _NEG)[:, None].astype(np.float32)


def net_inputs(ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, table: np.ndarray, last_rows: np.ndarray,
               block_size: int, kv_heads: int, num_slots: int, paged: bool,
               token_rows: np.ndarray | None = None) -> tuple:
    """The network's inputs from ids/pos/slots [B, T], the block table [R, NB] and last_rows.

    The cache holds head h of slot s in row ``h * num_slots + s``; write_idx lists the rows of every new
    token's heads (token-major). The paged attention kernel takes the block table itself and each
    token's table row (``token_rows`` [B*T]; default: token (b, t) -> row b). The MindSpore ops path takes
    read rows [kv, B, W] (every head and key position of each row's window: the table's blocks, each
    expanded to its block_size slots) and an additive mask.
    """
    heads = np.arange(kv_heads, dtype=np.int64) * num_slots
    write_idx = (slots.reshape(-1, 1).astype(np.int64) + heads).reshape(-1).astype(np.int32)
    if paged:
        if token_rows is None:
            token_rows = np.repeat(np.arange(ids.shape[0], dtype=np.int32), ids.shape[1])
        return ids, pos, write_idx, table, token_rows.astype(np.int32), last_rows
    window_slots = (table[:, :, None].astype(np.int64) * block_size + np.arange(block_size)).reshape(len(table), -1)
    read_rows = (heads[:, None, None] + window_slots[None]).astype(np.int32)
    return ids, pos, write_idx, read_rows, _mask(pos, table.shape[1] * block_size), last_rows


MAX_AOT_HEAD_DIM = 512  # attention.cc kMaxHeadDim


def _aot_ops(spec: ModelSpec):
    """The AOT kernels (an ``AotOps``), or None with a warning where they cannot be built or do not fit
    the model."""
    from backends.mindspore.kernels import KernelBuildError, aot_ops

    if spec.head_dim % 2 or spec.head_dim > MAX_AOT_HEAD_DIM or spec.num_heads % spec.num_kv_heads:
        log.warning("AOT kernels do not support head_dim %d with %d heads / %d kv heads; using stock MindSpore "
                    "ops", spec.head_dim, spec.num_heads, spec.num_kv_heads)
        return None

    try:
        return aot_ops(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    except KernelBuildError as exc:
        log.warning("AOT kernels unavailable, using stock MindSpore ops: %s", exc)
        return None


KERNELS = ("auto", "aot", "ms")


class ModelRunner:
    def __init__(self, spec: ModelSpec, weights: dict[str, np.ndarray], shapes: Shapes, num_blocks: int,
                 kernels: str = "ms") -> None:
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        self.spec = spec
        aot = _aot_ops(spec) if kernels != "ms" else None
        if kernels == "aot" and aot is None:
            raise RuntimeError("kernels 'aot' asked for, but the AOT kernels could not be built (see the log)")
        self.paged = aot is not None
        if self.paged:
            # The kernel reads each token's real keys whatever the table width, so one window (the
            # largest) serves every length, and the tokens of a step are packed side by side in one row:
            # decode tokens (one per sequence) and prompt chunks alike. The graphs are per token count:
            # the decode batch buckets, 16, 32, ... below the prompt chunk, the chunk, and the chunk
            # plus a full decode batch (the most one step holds); each returns logits for up to
            # min(tokens, largest batch) sequences.
            batch = shapes.batch_buckets[-1]
            chunk = shapes.prefill_chunk
            sizes = {*shapes.batch_buckets, *(n for n in (16, 32, 64, 128, 256, 512) if n < chunk), chunk, chunk + batch}
            shapes = dataclasses.replace(shapes, window_buckets=(shapes.max_window,), prefill_sizes=tuple(sorted(sizes)))
        self.shapes = shapes
        log.info("kernels: %s", "AOT (matmul, paged attention, fused norm/rope/SwiGLU; row-deterministic)"
                 if self.paged else "stock MindSpore ops (MatMul, windowed attention)")
        self.num_slots = num_blocks * shapes.block_size
        if spec.num_kv_heads * self.num_slots >= 2**31:
            raise ValueError(f"a KV cache of {num_blocks} blocks x {shapes.block_size} tokens x {spec.num_kv_heads} "
                             "kv heads has more rows than int32 indices address; lower cacheBlockNum")
        self.net = LlamaModel(spec, weights, num_blocks, shapes.block_size, shapes.max_window, aot)
        self.net.set_train(False)
        self.head = LMHead(self.net)
        self.compiled: set[tuple] = set()

    def _call(self, key: tuple, ids, pos, slots, table, last_rows, token_rows=None):
        args = net_inputs(ids, pos, slots, table, last_rows, self.shapes.block_size, self.spec.num_kv_heads,
                          self.num_slots, self.paged, token_rows)
        started = time.perf_counter()
        logits, hidden = self.net(*(None if a is None else ms.Tensor(a) for a in args))
        out = logits.asnumpy(), hidden.asnumpy()
        if key not in self.compiled:
            self.compiled.add(key)
            log.info("compiled graph %s in %.2fs", key, time.perf_counter() - started)
        return out

    def prefill(self, chunks: list[PrefillChunk]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One prompt chunk for each of several sequences; returns (last-token logits [n, V], hidden [t_i, D] each).

        With the paged kernel the chunks are packed into one row (their total must fit the largest packed
        size; decode rows are 1-token chunks); otherwise each gets its own row, padded to ``prefill_chunk``.
        """
        if self.paged:
            return self._prefill_packed(chunks)
        size, n = self.shapes.prefill_chunk, len(chunks)
        batch = self.shapes.batch_for(n, prefill=True)
        window = self.shapes.window_for(max(c.start + len(c.ids) for c in chunks))
        ids = np.zeros((batch, size), np.int32)
        pos = np.zeros((batch, size), np.int32)
        slots = np.zeros((batch, size), np.int32)  # padding writes go to the scratch slot 0
        last_rows = np.arange(batch, dtype=np.int32) * size
        for i, c in enumerate(chunks):
            t = len(c.ids)
            assert 0 < t <= size, "chunk larger than the compiled prefill shape"
            ids[i, :t] = c.ids
            pos[i, :t] = np.arange(c.start, c.start + t)
            slots[i, :t] = token_slots(c.blocks, pos[i, :t], self.shapes.block_size)
            last_rows[i] += t - 1
        table = block_table([c.blocks for c in chunks] + [[]] * (batch - n), window // self.shapes.block_size)
        logits, hidden = self._call(("prefill", batch, size, window), ids, pos, slots.reshape(-1), table, last_rows)
        return logits[:n], [hidden[i * size: i * size + len(c.ids)] for i, c in enumerate(chunks)]

    def packed_rows(self, size: int) -> int:
        """Sequences (logit rows) a packed graph of ``size`` tokens serves."""
        return min(size, self.shapes.batch_buckets[-1])

    def _prefill_packed(self, chunks: list[PrefillChunk]) -> tuple[np.ndarray, list[np.ndarray]]:
        n, total = len(chunks), sum(len(c.ids) for c in chunks)
        assert 0 < total <= self.shapes.prefill_sizes[-1], "more tokens than the largest packed graph"
        size = next(s for s in self.shapes.prefill_sizes if s >= total)
        rows = self.packed_rows(size)
        assert n <= rows, "more sequences than the packed graph's logit rows"
        ids = np.zeros((1, size), np.int32)
        pos = np.zeros((1, size), np.int32)
        slots = np.zeros(size, np.int32)  # padding tokens write the scratch slot 0 and read table row 0
        token_rows = np.zeros(size, np.int32)
        last_rows = np.zeros(rows, np.int32)
        offsets = []
        at = 0
        for i, c in enumerate(chunks):
            t = len(c.ids)
            assert t > 0, "empty prefill chunk"
            ids[0, at:at + t] = c.ids
            pos[0, at:at + t] = np.arange(c.start, c.start + t)
            slots[at:at + t] = token_slots(c.blocks, pos[0, at:at + t], self.shapes.block_size)
            token_rows[at:at + t] = i
            last_rows[i] = at + t - 1
            offsets.append(at)
            at += t
        window = self.shapes.max_window
        table = block_table([c.blocks for c in chunks] + [[]] * (rows - n), window // self.shapes.block_size)
        logits, hidden = self._call(("packed", size, rows, window), ids, pos, slots, table, last_rows, token_rows)
        return logits[:n], [hidden[o: o + len(c.ids)] for o, c in zip(offsets, chunks)]

    def decode(self, rows: list[DecodeRow]) -> np.ndarray:
        """One token for each row; returns logits [len(rows), V]."""
        if self.paged:
            return self._prefill_packed([PrefillChunk([r.token], r.position, r.blocks) for r in rows])[0]
        n, batch = len(rows), self.shapes.batch_for(len(rows))
        window = self.shapes.window_for(max(r.position for r in rows) + 1)
        ids = np.zeros((batch, 1), np.int32)
        pos = np.zeros((batch, 1), np.int32)
        slots = np.zeros(batch, np.int32)
        for i, row in enumerate(rows):
            ids[i, 0], pos[i, 0] = row.token, row.position
            slots[i] = token_slots(row.blocks, pos[i], self.shapes.block_size)[0]
        table = block_table([r.blocks for r in rows] + [[]] * (batch - n), window // self.shapes.block_size)
        logits, _ = self._call(("decode", batch, window), ids, pos, slots, table, np.arange(batch, dtype=np.int32))
        return logits[:n]

    def prompt_logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits [t, V] for normed hidden rows of one prefill chunk (padded to the chunk shape)."""
        padded = np.zeros((self.shapes.prefill_chunk, hidden.shape[1]), np.float32)
        padded[: len(hidden)] = hidden
        key = ("head", self.shapes.prefill_chunk)
        started = time.perf_counter()
        out = self.head(ms.Tensor(padded)).asnumpy()[: len(hidden)]
        if key not in self.compiled:
            self.compiled.add(key)
            log.info("compiled graph %s in %.2fs", key, time.perf_counter() - started)
        return out

    def warmup_plan(self) -> list[tuple]:
        s = self.shapes
        if self.paged:
            plan: list[tuple] = [("packed", n, self.packed_rows(n), s.max_window) for n in s.prefill_sizes]
        else:
            plan = [("prefill", b, s.prefill_chunk, w) for b in s.prefill_batch_buckets for w in s.window_buckets]
            plan += [("decode", b, w) for b in s.batch_buckets for w in s.window_buckets]
        return plan + [("head", s.prefill_chunk)]

    def warmup(self, progress: bool = False) -> None:
        """Compile every graph shape the engine will use; only the scratch block is written."""
        from tqdm import tqdm

        plan = self.warmup_plan()
        started = time.perf_counter()
        for key in tqdm(plan, desc="warm-up: compiling graphs", disable=not progress, unit="graph"):
            if key[0] == "packed":  # one more token than the next smaller size: selects this one
                smaller = [n for n in self.shapes.prefill_sizes if n < key[1]]
                tokens = smaller[-1] + 1 if smaller else 1
                blocks = [0] * (key[3] // self.shapes.block_size)
                self.prefill([PrefillChunk([0] * tokens, key[3] - tokens, blocks)])
            elif key[0] == "prefill":
                self.prefill([PrefillChunk([0], key[3] - 1, [0] * (key[3] // self.shapes.block_size))] * key[1])
            elif key[0] == "decode":
                rows = [DecodeRow(0, key[2] - 1, [0] * (key[2] // self.shapes.block_size))] * key[1]
                self.decode(rows)
            else:
                self.prompt_logits(np.zeros((1, self.spec.hidden_size), np.float32))
        log.info("warm-up done: %d graphs in %.1fs", len(plan), time.perf_counter() - started)
