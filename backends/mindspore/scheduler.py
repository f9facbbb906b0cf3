"""Continuous-batching scheduler: who waits, who prefills, who decodes, and their cache blocks."""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from backends.base import RequestHandle
from backends.mindspore.kv_cache import BlockAllocator
from backends.types import Token


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine (per-row pieces are filterable: dropped with the row)."""

    handle: RequestHandle
    prompt_ids: list[int]
    max_new_tokens: int
    chooser: object  # sampling.NextTokenChooser
    stopper: object  # stopping.Stopper
    detokenizer: object  # tokenizer.IncrementalDetokenizer
    seed: int
    want_prefill: bool = False
    blocks: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already in the cache
    generated: list[int] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    prefill_tokens: list[Token] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def capacity(self) -> int:
        """Tokens this sequence may ever hold in the cache (prompt + max new tokens)."""
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass(frozen=True, slots=True)
class StepPlan:
    prefill: tuple[tuple[Sequence, int], ...]  # (sequence, tokens of its prompt to prefill now)
    decode: tuple[Sequence, ...]  # sequences that get one token each


PREFILL_FIRST = 3  # prefill-only steps in a row while prompts wait (separate prefill and decode calls)


class Scheduler:
    """FIFO admission under ``max_batch`` sequences and the cache budget.

    Each step prefills one chunk of up to ``prefill_rows`` prompts (at most ``prefill_tokens`` tokens in
    all) and decodes one token for every running sequence. With separate prefill and decode calls,
    prompts go first: while prompts wait, up to ``prefill_first`` steps in a row prefill without
    decoding (new requests get their first token sooner; the running ones pause for at most that many
    chunks), then a step decodes too. The AOT engine packs both into one forward, with
    ``prefill_first=0``: decoding never pauses.
    """

    def __init__(self, allocator: BlockAllocator, max_batch: int, max_waiting: int, *,
                 prefill_rows: int = 1, prefill_tokens: int = 64, chunk: int = 64,
                 prefill_first: int = PREFILL_FIRST) -> None:
        self.allocator, self.max_batch, self.max_waiting = allocator, max_batch, max_waiting
        self.prefill_rows, self.prefill_tokens, self.chunk = prefill_rows, prefill_tokens, chunk
        self.prefill_first = prefill_first
        self._prefill_streak = 0  # steps in a row that prefilled without decoding
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.running)

    def add(self, seq: Sequence) -> bool:
        if len(self.waiting) >= self.max_waiting:
            return False
        self.waiting.append(seq)
        return True

    def _admit(self) -> None:
        while self.waiting and self.active < self.max_batch:
            seq = self.waiting[0]
            if not self.allocator.can_allocate(seq.capacity):
                break  # FIFO: wait for blocks rather than overtaking
            self.waiting.popleft()
            # Reserve the whole (prompt + max_new_tokens) up front: no preemption needed mid-generation.
            seq.blocks = self.allocator.allocate(seq.capacity)
            self.prefilling.append(seq)

    def plan(self) -> StepPlan:
        self._admit()
        work, budget = [], self.prefill_tokens
        for seq in itertools.islice(self.prefilling, self.prefill_rows):
            n = min(self.chunk, len(seq.prompt_ids) - seq.prefilled, budget)
            if n <= 0:
                break
            work.append((seq, n))
            budget -= n
        if work and self.running and self._prefill_streak < self.prefill_first:
            self._prefill_streak += 1
            return StepPlan(tuple(work), ())
        self._prefill_streak = 0
        return StepPlan(tuple(work), tuple(self.running))

    def prefill_done(self, seq: Sequence) -> None:
        self.prefilling.remove(seq)
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its cache blocks."""
        for pool in (self.running, self.prefilling, self.waiting):
            if seq in pool:
                pool.remove(seq)
        self.allocator.release(seq.blocks)

    def all(self) -> list[Sequence]:
        return [*self.running, *self.prefilling, *self.waiting]
