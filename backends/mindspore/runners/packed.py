"""The AOT-kernel strategy: every step is one packed forward. The tokens of a step sit side by side in one
row, decode tokens (one per sequence) and prompt chunks alike, so decoding never waits for prompts; the
paged attention kernel reads each token's real keys through the block table, so one window serves every
length and each row is computed the same way whatever else is in the batch.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from backends.mindspore.runners.base import ModelRunner, write_rows
from backends.mindspore.runners.step import DecodeRow, PrefillChunk, RowOutput, StepBatch, block_table, token_slots
from backends.mindspore.planning.shapes import Shapes
from backends.settings import EngineConfig

PACKED_STEP, PACKED_STEPS = 16, 8  # packed token counts compiled every 16 tokens up to the largest (or 32, 48, ...:
#                                    at most 8 such sizes, so a large batch does not multiply the warm-up)


def packed_inputs(ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, table: np.ndarray, last_rows: np.ndarray,
                  kv_heads: int, num_slots: int, token_rows: np.ndarray | None = None,
                  window: tuple[np.ndarray, np.ndarray, int] | None = None) -> tuple:
    """ids/pos [1, T], slots [T], the block table [R, NB], each token's table row (``token_rows`` [T];
    default: token (b, t) -> row b) and last_rows [R] -> the network's inputs; with a window pool, ``window`` =
    (its slots [T], its table [R, NB], its slot count) adds its write rows and table."""
    if token_rows is None:
        token_rows = np.repeat(np.arange(ids.shape[0], dtype=np.int32), ids.shape[1])
    base = ids, pos, write_rows(slots, kv_heads, num_slots), table, token_rows.astype(np.int32), last_rows
    if window is None:
        return base
    window_slots, window_table, window_num_slots = window
    return (*base, write_rows(window_slots, kv_heads, window_num_slots), window_table)


class PackedRunner(ModelRunner):
    kernels = "aot"
    prefill_first = 0  # the decode rows ride along with the prompt chunks: decoding never pauses
    description = "AOT (matmul, paged attention, fused norm/rope/SwiGLU; row-deterministic)"

    def network(self, family, spec, weights, num_blocks, aot, dtype, lora):
        s = self.shapes
        pool = {"window_blocks": self.window_blocks} if self.window_blocks else {}
        return family.network("aot")(spec, weights, num_blocks, s.block_size, s.max_window, aot, lora=lora,
                                     kv_dtype=self.kv_dtype, **pool)

    _window: tuple[np.ndarray, np.ndarray, int] | None = None  # the window pool's inputs of the call being made

    def compiled_shapes(self, shapes: Shapes) -> Shapes:
        """One window (the largest); graphs per packed token count: the decode batch buckets, the prompt chunk,
        the chunk plus a full decode batch (the most one step holds), and every 16 tokens below that (a step's
        tokens are padded to the next size: a prompt's last chunk beside the decode rows pads 15 at most)."""
        batch, chunk = shapes.batch_buckets[-1], shapes.prefill_chunk
        step = PACKED_STEP * -(-(chunk + batch) // (PACKED_STEP * PACKED_STEPS))
        sizes = {*shapes.batch_buckets, *range(step, chunk + batch, step), chunk, chunk + batch}
        return dataclasses.replace(shapes, window_buckets=(shapes.max_window,), prefill_sizes=tuple(sorted(sizes)))

    def prefill_budget(self, config: EngineConfig) -> int:
        return self.shapes.prefill_chunk

    def step_tokens(self) -> int:
        return self.shapes.prefill_sizes[-1]

    def run(self, batch: StepBatch) -> list[RowOutput]:
        """Decode tokens (chunks of one token, or 1 + k with drafts) and prompt chunks in one packed forward;
        a decode row's drafts get the logits of every position (``RowOutput.verify``)."""
        if not batch.prefill:
            outs = self.decode_rows(batch) if batch.decode else []
        else:
            outs = self.isolated(self.prefill, [r.chunk() for r in batch.decode] + list(batch.prefill),
                                 batch.decode_outputs() + batch.prefill_outputs())
        for out in outs[:len(batch.decode)]:
            out.hidden = None
            if out.drafts and out.error is None:
                out.logits, out.verify = out.logits[0], out.logits[1:]
        return outs

    def draft_budget(self, decode_rows: int, prefill_rows: int) -> int:
        """Draft tokens a step may add: each takes a logit row, and the step's logit rows stay within the largest
        batch (so the token count stays within the chunk plus a batch: every packed graph is warmed up)."""
        return max(0, self.shapes.batch_buckets[-1] - decode_rows - prefill_rows)

    def fit_drafts(self, tokens: int, drafts: int) -> int:
        """Of ``drafts`` draft tokens wanted on a step of ``tokens`` tokens, how many to send: the step runs the
        smallest compiled size that holds it, so drafts fill its padding for free, and beyond that they stop at
        the largest compiled size they reach (a draft that would pull in the next size alone costs the most)."""
        sizes = self.shapes.prefill_sizes
        own = next((s for s in sizes if s >= tokens), tokens)
        reached = max((s for s in sizes if s <= tokens + drafts), default=tokens)
        return min(drafts, max(own, reached) - tokens)

    def packed_rows(self, size: int) -> int:
        """Sequences (logit rows) a packed graph of ``size`` tokens serves."""
        return min(size, self.shapes.batch_buckets[-1])

    def _prefill(self, chunks: list[PrefillChunk]) -> tuple[np.ndarray | list[np.ndarray], list[np.ndarray]]:
        """The chunks packed into one row (their total must fit the largest packed size): their logits [n, V]
        (a list when a chunk wants more than its last token's: its entry [logit_tokens, V]) and hidden rows."""
        n, total = len(chunks), sum(len(c.ids) for c in chunks)
        wanted = sum(c.logit_tokens for c in chunks)
        assert 0 < total <= self.shapes.prefill_sizes[-1], "more tokens than the largest packed graph"
        size = next(s for s in self.shapes.prefill_sizes if s >= total)
        rows = self.packed_rows(size)
        assert wanted <= rows, "more logit rows than the packed graph's"
        ids = np.zeros((1, size), np.int32)
        pos = np.zeros((1, size), np.int32)
        slots = np.zeros(size, np.int32)  # padding tokens write the scratch slot 0 and read table row 0
        token_rows = np.zeros(size, np.int32)
        lora_rows = np.full(size, -1, np.int32)  # each token's adapter slot; padding: none
        last_rows = np.zeros(rows, np.int32)
        tables: list[list[int]] = [[]] * rows  # table row of chunk i: its first logit row
        window_slots = np.zeros(size, np.int32) if self.window_blocks else None  # the window pool's
        window_tables: list[list[int]] = [[]] * rows
        offsets, firsts = [], []
        at = first = 0
        for c in chunks:
            t = len(c.ids)
            assert 0 < c.logit_tokens <= t, "empty prefill chunk, or more logit rows than tokens"
            ids[0, at:at + t] = c.ids
            pos[0, at:at + t] = np.arange(c.start, c.start + t)
            slots[at:at + t] = token_slots(c.blocks, pos[0, at:at + t], self.shapes.block_size)
            token_rows[at:at + t] = first
            lora_rows[at:at + t] = c.lora
            last_rows[first:first + c.logit_tokens] = np.arange(at + t - c.logit_tokens, at + t)
            tables[first] = c.blocks
            if window_slots is not None:  # a chunk without window blocks (the warm-up's) has the scratch block's
                local = c.local_blocks if c.local_blocks is not None else [0] * len(c.blocks)
                window_slots[at:at + t] = token_slots(local, pos[0, at:at + t], self.shapes.block_size)
                window_tables[first] = local
            offsets.append(at)
            firsts.append(first)
            at += t
            first += c.logit_tokens
        window = self.shapes.max_window
        table = block_table(tables, window // self.shapes.block_size)
        self._window = None if window_slots is None else (
            window_slots, block_table(window_tables, window // self.shapes.block_size),
            self.window_blocks * self.shapes.block_size)
        logits, hidden = self._call(("packed", size, rows, window), ids, pos, slots, table, last_rows, token_rows,
                                    lora_rows, chunks, [(0, o) for o in offsets])
        rows_out = logits[:n] if wanted == n else [logits[f] if c.logit_tokens == 1 else logits[f:f + c.logit_tokens]
                                                   for f, c in zip(firsts, chunks)]
        return rows_out, [hidden[o: o + len(c.ids)] for o, c in zip(offsets, chunks)]

    def _decode(self, rows: list[DecodeRow]) -> np.ndarray | list[np.ndarray]:
        """Decode rows alone: logits [n, V] (a list with [1 + k, V] entries when a row carries drafts)."""
        return self._prefill([r.chunk() for r in rows])[0]

    def warmup_plan(self) -> list[tuple]:
        s = self.shapes
        return [("packed", n, self.packed_rows(n), s.max_window) for n in s.prefill_sizes] + [("head", self.head_rows)]

    def _warm(self, key: tuple) -> None:
        _, size, rows, window = key  # one more token than the next smaller size selects this one
        smaller = [n for n in self.shapes.prefill_sizes if n < size]
        tokens = smaller[-1] + 1 if smaller else 1
        # On the scratch block only, in sequences of at most a window each (a chunk plus a decode batch may be
        # more tokens than one window holds): every position stays inside the rotary tables.
        blocks = [0] * (window // self.shapes.block_size)
        lengths = [min(window, tokens - at) for at in range(0, tokens, window)]
        assert len(lengths) <= rows, "a warm-up step with more sequences than the graph's logit rows"
        self.prefill([PrefillChunk([0] * t, window - t, blocks) for t in lengths])

    def graph_inputs(self, ids, pos, slots, table, last_rows, token_rows=None) -> tuple:
        return packed_inputs(ids, pos, slots, table, last_rows, self.spec.num_kv_heads, self.num_slots, token_rows,
                             self._window)
