"""Paged KV-cache bookkeeping: fixed-size blocks with reference counts, each sequence's block table, and the
prefix cache: a full prompt block is known by the hash of its tokens chained with every block before it (and
the adapter, and the media items whose tokens it holds), so a later prompt that starts the same way shares
it instead of prefilling it again.

Block 0 is reserved as the scratch block: padding tokens write there and padded table entries point
there, so no real sequence ever reads it unmasked.
"""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

SCRATCH_BLOCK = 0


class CacheFull(RuntimeError):
    pass


def block_hashes(ids: Sequence[int], block_size: int, adapter: str | None = None,
                 media: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:
    """The chained hash of each full block of ``ids``: block i's covers its tokens, every token before them,
    the adapter (None: the base model) and the digest of every media item whose tokens ``[start, end)``
    overlap it (every image's placeholder ids are equal, its K/V are not), so equal hashes mean equal K/V."""
    digest, out = hashlib.sha256(f"adapter:{adapter or ''}".encode()).digest(), []
    tokens = np.asarray(ids, dtype=np.int64)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        items = b"".join(d for a, b, d in media if a < end and b > start)
        digest = hashlib.sha256(digest + tokens[start:end].tobytes() + items).digest()
        out.append(digest)
    return out


class BlockAllocator:
    """Blocks handed out by reference count. With ``prefix_caching``, a registered (full prompt) block that
    nobody uses any more stays in the cache, findable by its hash, and is evicted least recently used only
    when no plain free block is left."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is scratch), got {num_blocks}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unused; LRU first

    @property
    def free_blocks(self) -> int:
        """Blocks a new sequence may take: the plain free ones and the cached ones nobody uses."""
        return len(self._free) + len(self._idle)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def cached_blocks(self) -> int:
        """Blocks findable by their hash (in use or idle)."""
        return len(self._hash_of)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` from the first (empty without prefix caching)."""
        out = []
        for digest in hashes if self.prefix_caching else ():
            block = self._by_hash.get(digest)
            if block is None:
                break
            out.append(block)
        return out

    def can_allocate(self, tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether a sequence of ``tokens`` fits, its first blocks being ``cached`` (from ``match``)."""
        idle_reused = sum(1 for b in cached if self._refs[b] == 0)
        return self.blocks_for(tokens) - len(cached) <= self.free_blocks - idle_reused

    def allocate(self, tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """The blocks of a sequence of ``tokens``: ``cached`` (shared), then fresh ones."""
        if not self.can_allocate(tokens, cached):
            raise CacheFull(f"need {self.blocks_for(tokens) - len(cached)} cache blocks, {self.free_blocks} free")
        for block in cached:
            self._idle.pop(block, None)
            self._refs[block] += 1
        return [*cached, *(self._take() for _ in range(self.blocks_for(tokens) - len(cached)))]

    def register(self, block: int, digest: bytes) -> None:
        """Make a full block findable by ``digest`` (once its K/V are written); a digest already cached keeps
        its block, and this one stays private."""
        if self.prefix_caching and digest not in self._by_hash and block not in self._hash_of:
            self._by_hash[digest], self._hash_of[block] = block, digest

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; an unused cached block stays findable (the sequence's last
        blocks are evicted first), another goes back to the free list."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._idle[block] = None
            else:
                self._free.append(block)
        blocks.clear()

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently used idle cached block
            block, _ = self._idle.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block


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
