"""The AOT-kernel strategy: every step is one packed forward. The tokens of a step sit side by side in one
row, decode tokens (one per sequence) and prompt chunks alike, so decoding never waits for prompts; the
paged attention kernel reads each token's real keys through the block table, so one window serves every
length and each row is computed the same way whatever else is in the batch.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from backends.mindspore.kv_cache import block_table, token_slots
from backends.mindspore.network.llama import AotLlama
from backends.mindspore.runners.base import ModelRunner, write_rows
from backends.mindspore.step import DecodeRow, PrefillChunk, RowOutput, StepBatch
from backends.mindspore.shapes import Shapes
from backends.settings import EngineConfig

PACKED_SIZES = (16, 32, 64, 128, 256, 512)  # packed token counts compiled below the prompt chunk


def packed_inputs(ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, table: np.ndarray, last_rows: np.ndarray,
                  kv_heads: int, num_slots: int, token_rows: np.ndarray | None = None) -> tuple:
    """ids/pos [1, T], slots [T], the block table [R, NB], each token's table row (``token_rows`` [T];
    default: token (b, t) -> row b) and last_rows [R] -> the network's inputs."""
    if token_rows is None:
        token_rows = np.repeat(np.arange(ids.shape[0], dtype=np.int32), ids.shape[1])
    return ids, pos, write_rows(slots, kv_heads, num_slots), table, token_rows.astype(np.int32), last_rows


class PackedRunner(ModelRunner):
    kernels = "aot"
    prefill_first = 0  # the decode rows ride along with the prompt chunks: decoding never pauses
    description = "AOT (matmul, paged attention, fused norm/rope/SwiGLU; row-deterministic)"

    def network(self, spec, weights, num_blocks, aot, dtype, lora, vl):
        s = self.shapes
        if vl is not None:
            from backends.mindspore.qwen2_vl.text import AotQwen2VLText

            return AotQwen2VLText(vl, weights, num_blocks, s.block_size, s.max_window, aot, self.kv_dtype)
        return AotLlama(spec, weights, num_blocks, s.block_size, s.max_window, aot, lora, self.kv_dtype)

    def compiled_shapes(self, shapes: Shapes) -> Shapes:
        """One window (the largest); graphs per packed token count: the decode batch buckets, 16, 32, ...
        below the prompt chunk, the chunk, and the chunk plus a full decode batch (the most one step holds)."""
        batch, chunk = shapes.batch_buckets[-1], shapes.prefill_chunk
        sizes = {*shapes.batch_buckets, *(n for n in PACKED_SIZES if n < chunk), chunk, chunk + batch}
        return dataclasses.replace(shapes, window_buckets=(shapes.max_window,), prefill_sizes=tuple(sorted(sizes)))

    def prefill_budget(self, config: EngineConfig) -> int:
        return self.shapes.prefill_chunk

    def run(self, batch: StepBatch) -> list[RowOutput]:
        """Decode tokens (1-token chunks) and prompt chunks in one packed forward."""
        if not batch.prefill:
            return self.decode_rows(batch) if batch.decode else []
        rows = [PrefillChunk([r.token], r.position, r.blocks, r.lora, delta=r.delta) for r in batch.decode]
        return self.isolated(self.prefill, rows + list(batch.prefill), batch.decode_outputs() + batch.prefill_outputs())

    def packed_rows(self, size: int) -> int:
        """Sequences (logit rows) a packed graph of ``size`` tokens serves."""
        return min(size, self.shapes.batch_buckets[-1])

    def _prefill(self, chunks: list[PrefillChunk]) -> tuple[np.ndarray, list[np.ndarray]]:
        """The chunks packed into one row (their total must fit the largest packed size)."""
        n, total = len(chunks), sum(len(c.ids) for c in chunks)
        assert 0 < total <= self.shapes.prefill_sizes[-1], "more tokens than the largest packed graph"
        size = next(s for s in self.shapes.prefill_sizes if s >= total)
        rows = self.packed_rows(size)
        assert n <= rows, "more sequences than the packed graph's logit rows"
        ids = np.zeros((1, size), np.int32)
        pos = np.zeros((1, size), np.int32)
        slots = np.zeros(size, np.int32)  # padding tokens write the scratch slot 0 and read table row 0
        token_rows = np.zeros(size, np.int32)
        lora_rows = np.full(size, -1, np.int32)  # each token's adapter slot; padding: none
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
            lora_rows[at:at + t] = c.lora
            last_rows[i] = at + t - 1
            offsets.append(at)
            at += t
        window = self.shapes.max_window
        table = block_table([c.blocks for c in chunks] + [[]] * (rows - n), window // self.shapes.block_size)
        logits, hidden = self._call(("packed", size, rows, window), ids, pos, slots, table, last_rows, token_rows,
                                    lora_rows, chunks, [(0, o) for o in offsets])
        return logits[:n], [hidden[o: o + len(c.ids)] for o, c in zip(offsets, chunks)]

    def _decode(self, rows: list[DecodeRow]) -> np.ndarray:
        return self._prefill([PrefillChunk([r.token], r.position, r.blocks, r.lora, delta=r.delta) for r in rows])[0]

    def warmup_plan(self) -> list[tuple]:
        s = self.shapes
        return [("packed", n, self.packed_rows(n), s.max_window) for n in s.prefill_sizes] + [("head", s.prefill_chunk)]

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
        return packed_inputs(ids, pos, slots, table, last_rows, self.spec.num_kv_heads, self.num_slots, token_rows)
