"""The stock-op strategy: a step is a prefill call (each prompt chunk its own row, padded to the chunk),
then a decode call; attention gathers each row's window of the cache (bucketed window sizes) under an
additive mask. Prompts go first (``PREFILL_FIRST``), as the two calls cannot share a forward.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from backends.mindspore.runners.base import ModelRunner, write_rows
from backends.mindspore.runners.step import (PREFILL_FIRST, DecodeRow, PrefillChunk, RowOutput, StepBatch, block_table,
                                            token_slots)
from backends.settings import EngineConfig

_NEG = np.float32(-1e9)


def _mask(pos: np.ndarray, window: int) -> np.ndarray:
    """Additive attention mask [B, 1, T, W]: key j is visible to the token at position p iff j <= p."""
    visible = np.arange(window)[None, None, :] <= pos[:, :, None]
    return np.where(visible, np.float32(0), _NEG)[:, None].astype(np.float32)


def window_inputs(ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, table: np.ndarray, last_rows: np.ndarray,
                  block_size: int, kv_heads: int, num_slots: int) -> tuple:
    """ids/pos/slots [B, T], the block table [B, NB] and last_rows -> the network's inputs: read rows
    [kv, B, W] (every head and key position of each row's window: the table's blocks, each expanded to its
    block_size slots) and the mask."""
    heads = np.arange(kv_heads, dtype=np.int64) * num_slots
    window_slots = (table[:, :, None].astype(np.int64) * block_size + np.arange(block_size)).reshape(len(table), -1)
    read_rows = (heads[:, None, None] + window_slots[None]).astype(np.int32)
    return (ids, pos, write_rows(slots, kv_heads, num_slots), read_rows,
            _mask(pos, table.shape[1] * block_size), last_rows)


class SplitRunner(ModelRunner):
    kernels = "stock"
    prefill_first = PREFILL_FIRST
    description = "stock MindSpore ops (MatMul, windowed attention)"

    def network(self, family, spec, weights, num_blocks, aot, dtype, lora):
        s = self.shapes
        return family.network("stock")(spec, weights, num_blocks, s.block_size, s.max_window, dtype=dtype, lora=lora)

    def prefill_budget(self, config: EngineConfig) -> int:
        return max(config.max_prefill_tokens, self.shapes.prefill_chunk)

    def run(self, batch: StepBatch) -> Iterator[RowOutput]:
        """The prefill call, its rows handed out before the decode call runs."""
        if batch.prefill:
            yield from self.isolated(self.prefill, list(batch.prefill), batch.prefill_outputs())
        if batch.decode:
            yield from self.decode_rows(batch)

    def _prefill(self, chunks: list[PrefillChunk]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Each chunk its own row, padded to ``prefill_chunk``."""
        size, n = self.shapes.prefill_chunk, len(chunks)
        batch = self.shapes.batch_for(n, prefill=True)
        window = self.shapes.window_for(max(c.start + len(c.ids) for c in chunks))
        ids = np.zeros((batch, size), np.int32)
        pos = np.zeros((batch, size), np.int32)
        slots = np.zeros((batch, size), np.int32)  # padding writes go to the scratch slot 0
        lora_rows = np.full((batch, size), -1, np.int32)  # each token's adapter slot; padding: none
        last_rows = np.arange(batch, dtype=np.int32) * size
        for i, c in enumerate(chunks):
            t = len(c.ids)
            assert 0 < t <= size, "chunk larger than the compiled prefill shape"
            ids[i, :t] = c.ids
            pos[i, :t] = np.arange(c.start, c.start + t)
            slots[i, :t] = token_slots(c.blocks, pos[i, :t], self.shapes.block_size)
            lora_rows[i, :t] = c.lora
            last_rows[i] += t - 1
        table = block_table([c.blocks for c in chunks] + [[]] * (batch - n), window // self.shapes.block_size)
        logits, hidden = self._call(("prefill", batch, size, window), ids, pos, slots.reshape(-1), table, last_rows,
                                    lora_rows=lora_rows.reshape(-1), chunks=chunks, places=[(i, 0) for i in range(n)])
        return logits[:n], [hidden[i * size: i * size + len(c.ids)] for i, c in enumerate(chunks)]

    def _decode(self, rows: list[DecodeRow]) -> np.ndarray:
        n, batch = len(rows), self.shapes.batch_for(len(rows))
        window = self.shapes.window_for(max(r.position for r in rows) + 1)
        ids = np.zeros((batch, 1), np.int32)
        pos = np.zeros((batch, 1), np.int32)
        slots = np.zeros(batch, np.int32)
        lora_rows = np.full(batch, -1, np.int32)
        for i, row in enumerate(rows):
            ids[i, 0], pos[i, 0], lora_rows[i] = row.token, row.position, row.lora
            slots[i] = token_slots(row.blocks, pos[i], self.shapes.block_size)[0]
        table = block_table([r.blocks for r in rows] + [[]] * (batch - n), window // self.shapes.block_size)
        chunks = [PrefillChunk([r.token], r.position, r.blocks, delta=r.delta) for r in rows]  # for media_inputs
        logits, _ = self._call(("decode", batch, window), ids, pos, slots, table, np.arange(batch, dtype=np.int32),
                               lora_rows=lora_rows, chunks=chunks, places=[(i, 0) for i in range(n)], hidden=False)
        return logits[:n]

    def warmup_plan(self) -> list[tuple]:
        s = self.shapes
        plan = [("prefill", b, s.prefill_chunk, w) for b in s.prefill_batch_buckets for w in s.window_buckets]
        plan += [("decode", b, w) for b in s.batch_buckets for w in s.window_buckets]
        return plan + [("head", self.head_rows)]

    def _warm(self, key: tuple) -> None:
        window = key[-1]
        blocks = [0] * (window // self.shapes.block_size)
        if key[0] == "prefill":
            self.prefill([PrefillChunk([0], window - 1, blocks)] * key[1])
        else:
            self.decode([DecodeRow(0, window - 1, blocks)] * key[1])

    def graph_inputs(self, ids, pos, slots, table, last_rows, token_rows=None) -> tuple:
        return window_inputs(ids, pos, slots, table, last_rows, self.shapes.block_size, self.spec.num_kv_heads,
                             self.num_slots)
