"""The sliding-window layers' own cache blocks (Gemma 3's local layers): a query at position p of such a layer
reads only the keys (p - window, p], so a sequence needs only the blocks of its last window (and of the tokens
a step computes). ``WindowPool`` hands each sequence those blocks from a smaller pool, block i of its local
table beside block i of its full-length table, and gives back the ones that slid out of its window before the
step that no longer reads them; the global layers keep the full-length pool (``kv_cache.BlockAllocator``).

The sizing rule: a step computes at most ``row_tokens`` positions [s, s + t) of a sequence, whose queries read
keys from s - window + 1 on, so at most ``live_blocks`` blocks of a sequence are alive at once. A sequence is
admitted only while the pool holds that many for every admitted one (a reservation, not a count of free
blocks: the blocks a sequence shares with others are counted by each), so a block is always there to take.

The prefix cache: a full prompt block's local rows are findable by the same hash as its global rows
(``register``) and stay cached (idle, evicted least recently used) once out of every window. A prefix hit of n
blocks is usable only when the local rows of the window before block n are all still cached (``match``: the
hit is shortened to the longest n for which they are); the rows before that window are never read again.
"""
from __future__ import annotations

from collections.abc import Sequence

from backends.mindspore.engine.kv_cache import BlockAllocator
from backends.mindspore.planning.windows import live_blocks
from backends.mindspore.runners.step import SCRATCH_BLOCK


def first_read(start: int, window: int, block_size: int) -> int:
    """The first block a query at position ``start`` (or later) reads in a sliding-window layer."""
    return max(0, start - window + 1) // block_size


class WindowPool:
    """The local layers' blocks of every sequence (``local_blocks`` on each, as long as its full table, the
    scratch block where a block is out of its window or not yet written), by reservation of ``per_sequence``
    blocks each (fewer for a sequence shorter than that)."""

    def __init__(self, allocator: BlockAllocator, window: int, row_tokens: int) -> None:
        self.allocator, self.window = allocator, window
        self.block_size = allocator.block_size
        self.per_sequence = live_blocks(window, self.block_size, row_tokens)
        self._reserved: dict[object, int] = {}  # sequence -> blocks reserved for it

    @property
    def reserved(self) -> int:
        return sum(self._reserved.values())

    def reservation(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` positions reserves."""
        return min(self.per_sequence, self.allocator.blocks_for(tokens))

    def can_admit(self, tokens: int) -> bool:
        return self.reserved + self.reservation(tokens) <= self.allocator.usable_blocks

    def match(self, hashes: Sequence[bytes], cached: int) -> tuple[int, list[int]]:
        """(n, blocks): the longest prefix hit of n <= ``cached`` full blocks whose window's local blocks are all
        cached, and those blocks (of blocks first_read(n * block_size) .. n - 1)."""
        for n in range(cached if self.allocator.prefix_caching else 0, 0, -1):
            first = first_read(n * self.block_size, self.window, self.block_size)
            found = [self.allocator.find(digest) for digest in hashes[first:n]]
            if None not in found:
                return n, found
        return 0, []

    def admit(self, seq, tokens: int, cached: int, blocks: list[int]) -> None:
        """Reserve ``seq``'s blocks and share ``blocks`` (from ``match``) for its first ``cached`` full blocks'
        window."""
        self._reserved[seq] = self.reservation(tokens)
        first = cached - len(blocks)
        shared = self.allocator.allocate(len(blocks) * self.block_size, blocks) if blocks else []
        seq.local_blocks = [SCRATCH_BLOCK] * first + shared

    def advance(self, seq, start: int, end: int) -> None:
        """Before a step computes positions [start, end) of ``seq``: give back the blocks no query from
        ``start`` on reads, take the blocks [start, end) writes."""
        local, size = seq.local_blocks, self.block_size
        for i in range(min(first_read(start, self.window, size), len(local))):
            if local[i] != SCRATCH_BLOCK:
                self.allocator.release([local[i]])
                local[i] = SCRATCH_BLOCK
        last = (end - 1) // size
        if last >= len(local):
            local.extend([SCRATCH_BLOCK] * (last + 1 - len(local)))
        for i in range(start // size, last + 1):
            if local[i] == SCRATCH_BLOCK:
                local[i] = self.allocator.allocate(size)[0]

    def register(self, seq, hashes: Sequence[bytes]) -> None:
        """Make ``seq``'s written full prompt blocks (``hashes``: theirs) findable, those still in its window."""
        for digest, block in zip(hashes, seq.local_blocks):
            if block != SCRATCH_BLOCK:
                self.allocator.register(block, digest)

    def finish(self, seq) -> None:
        self.allocator.release([b for b in seq.local_blocks if b != SCRATCH_BLOCK])
        seq.local_blocks = []
        self._reserved.pop(seq, None)
