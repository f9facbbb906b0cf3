"""Paged KV-cache bookkeeping: fixed-size blocks with reference counts, each sequence's block table, and the
prefix cache: a full prompt block is known by the hash of its tokens chained with every block before it (and
the adapter, and the media items whose tokens it holds), so a later prompt that starts the same way shares
it instead of prefilling it again. Inside a block, every ``part`` tokens of a prompt (16) are known the same
way: a later prompt that shares only the first parts of a block (a prompt shorter than a block, or one that
differs inside it) gets a fresh block with those rows copied from the cached one.

Block 0 is reserved as the scratch block: padding tokens write there and padded table entries point
there, so no real sequence ever reads it unmasked.
"""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from backends.mindspore.runners.step import SCRATCH_BLOCK


class CacheFull(RuntimeError):
    pass


PART_TOKENS = 16  # the prefix cache's unit inside a block (vLLM's default block size)


def _seed(adapter: str | None) -> bytes:
    return hashlib.sha256(f"adapter:{adapter or ''}".encode()).digest()


def _digest(before: bytes, tokens: np.ndarray, start: int, end: int, media: Sequence[tuple[int, int, bytes]],
            kind: bytes = b"") -> bytes:
    """The hash of ``tokens[start:end]`` after ``before`` (the chain so far), with every media item overlapping it."""
    items = b"".join(d for a, b, d in media if a < end and b > start)
    return hashlib.sha256(kind + before + tokens[start:end].tobytes() + items).digest()


def block_hashes(ids: Sequence[int], block_size: int, adapter: str | None = None,
                 media: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:
    """The chained hash of each full block of ``ids``: block i's covers its tokens, every token before them,
    the adapter (None: the base model) and the digest of every media item whose tokens ``[start, end)``
    overlap it (every image's placeholder ids are equal, its K/V are not), so equal hashes mean equal K/V."""
    digest, out = _seed(adapter), []
    tokens = np.asarray(ids, dtype=np.int64)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = _digest(digest, tokens, start, start + block_size, media)
        out.append(digest)
    return out


def part_hashes(ids: Sequence[int], block_size: int, part: int, full: Sequence[bytes], adapter: str | None = None,
                media: Sequence[tuple[int, int, bytes]] = ()) -> list[list[bytes]]:
    """For each block of ``ids`` (the last one may be partial), the hashes of its first ``part``, ``2 part``, ...
    tokens short of a full block, each chained on the full blocks before it (``full``: ``block_hashes``), so
    equal hashes mean equal K/V in those rows of the block. Empty without parts (``part`` 0)."""
    if not part:
        return []
    tokens, out = np.asarray(ids, dtype=np.int64), []
    for i, start in enumerate(range(0, len(tokens) - part + 1, block_size)):
        before = full[i - 1] if i else _seed(adapter)
        ends = range(start + part, min(start + block_size - 1, len(tokens)) + 1, part)
        out.append([_digest(before, tokens, start, end, media, b"part") for end in ends])
    return out


class BlockAllocator:
    """Blocks handed out by reference count. With ``prefix_caching``, a registered (full prompt) block that
    nobody uses any more stays in the cache, findable by its hash, and is evicted least recently used only
    when no plain free block is left. With ``part_size`` as well (a divisor of the block size below it), a
    block's first parts are findable by their hashes too (``register_part``, ``match_part``), and the block
    stays in the cache for them in the same way."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, part_size: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is scratch), got {num_blocks}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.part_size = part_size if prefix_caching and 0 < part_size < block_size and not block_size % part_size \
            else 0
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._by_part: dict[bytes, int] = {}
        self._parts_of: dict[int, list[bytes]] = {}
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
        """Blocks findable by a hash, of the block or of its first parts (in use or idle)."""
        return len(self._hash_of) + sum(1 for b in self._parts_of if b not in self._hash_of)

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

    def find(self, digest: bytes) -> int | None:
        """The cached block of one full-block hash, or None (always None without prefix caching)."""
        return self._by_hash.get(digest) if self.prefix_caching else None

    def match_part(self, hashes: Sequence[bytes]) -> tuple[int, int] | None:
        """(block, rows): the cached block whose first ``rows`` tokens are the most of ``hashes`` (``part_hashes``
        of one block, from the first part on), or None."""
        for k in range(len(hashes) if self.part_size else 0, 0, -1):
            block = self._by_part.get(hashes[k - 1])
            if block is not None:
                return block, k * self.part_size
        return None

    def can_allocate(self, tokens: int, cached: Sequence[int] = (), source: int | None = None,
                     adopt: bool = False) -> bool:
        """Whether a sequence of ``tokens`` fits, its first blocks being ``cached`` (from ``match``) and the block
        after them ``source``'s rows (from ``match_part``): held while they are copied, or adopted (below)."""
        held = {*cached, *(() if source is None or adopt else (source,))}
        idle_reused = sum(1 for b in held if self._refs[b] == 0)
        return self.blocks_for(tokens) - len(cached) <= self.free_blocks - idle_reused

    def allocate(self, tokens: int, cached: Sequence[int] = (), source: int | None = None,
                 adopt: bool = False) -> list[int]:
        """The blocks of a sequence of ``tokens``: ``cached`` (shared), then fresh ones. A ``source`` block (its
        rows to copy into the first fresh one) is held meanwhile, not evicted: ``release([source])`` after the
        copy. With ``adopt``, an idle ``source`` is that first block itself, its rows already there: nobody else
        uses it, and it is no longer findable (the sequence writes over its later rows)."""
        if adopt and source not in self._idle:
            raise ValueError(f"block {source} is in use: it can be held for a copy, not adopted")
        if not self.can_allocate(tokens, cached, source, adopt):
            raise CacheFull(f"need {self.blocks_for(tokens) - len(cached)} cache blocks, {self.free_blocks} free")
        for block in (*cached, *(() if source is None or adopt else (source,))):
            self._idle.pop(block, None)
            self._refs[block] += 1
        if adopt:
            del self._idle[source]
            self._forget(source)
            self._refs[source] = 1
        first = [source] if adopt else []
        return [*cached, *first, *(self._take() for _ in range(self.blocks_for(tokens) - len(cached) - len(first)))]

    def register(self, block: int, digest: bytes) -> None:
        """Make a full block findable by ``digest`` (once its K/V are written); a digest already cached keeps
        its block, and this one stays private."""
        if self.prefix_caching and digest not in self._by_hash and block not in self._hash_of:
            self._by_hash[digest], self._hash_of[block] = block, digest

    def register_part(self, block: int, digest: bytes) -> None:
        """Make a block's first rows findable by ``digest`` (``part_hashes``; once they are written), as
        ``register`` does for a full block."""
        if self.part_size and digest not in self._by_part:
            self._by_part[digest] = block
            self._parts_of.setdefault(block, []).append(digest)

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; an unused cached block stays findable (the sequence's last
        blocks are evicted first), another goes back to the free list."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of or block in self._parts_of:
                self._idle[block] = None
            else:
                self._free.append(block)
        blocks.clear()

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently used idle cached block
            block, _ = self._idle.popitem(last=False)
            self._forget(block)
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        """``block`` is findable no more (its hash, its parts')."""
        if block in self._hash_of:
            del self._by_hash[self._hash_of.pop(block)]
        for digest in self._parts_of.pop(block, ()):
            del self._by_part[digest]
