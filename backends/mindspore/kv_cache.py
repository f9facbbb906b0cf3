"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and each sequence's block table.

Block 0 is reserved as the scratch block: padding tokens write there and padded table entries point
there, so no real sequence ever reads it unmasked.
"""
from __future__ import annotations

import numpy as np

SCRATCH_BLOCK = 0


class CacheFull(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is scratch), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out low ids first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self._free)

    def allocate(self, tokens: int) -> list[int]:
        n = self.blocks_for(tokens)
        if n > len(self._free):
            raise CacheFull(f"need {n} cache blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()


def token_slots(blocks: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """Flat cache slot of each position of one sequence."""
    table = np.asarray(blocks, dtype=np.int32)
    return table[positions // block_size] * block_size + positions % block_size


def block_table(rows: list[list[int]], width: int) -> np.ndarray:
    """[B, width] table, each row a sequence's blocks padded with the scratch block."""
    out = np.full((len(rows), width), SCRATCH_BLOCK, dtype=np.int32)
    for i, blocks in enumerate(rows):
        n = min(len(blocks), width)
        out[i, :n] = blocks[:n]
    return out
