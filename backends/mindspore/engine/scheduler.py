"""Continuous-batching scheduler: who waits, who prefills, who decodes, and their cache blocks."""
from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from backends.mindspore.engine.kv_cache import BlockAllocator, block_hashes, part_hashes
from backends.mindspore.runners.step import PREFILL_FIRST
from backends.mindspore.engine.lora_slots import adapter_fits
from backends.mindspore.engine.sequence import SeqState
from backends.mindspore.engine.window_pool import WindowPool
from backends.mindspore.runners.step import StepBatch


@dataclass(frozen=True, slots=True)
class StepPlan:
    prefill: tuple[tuple[SeqState, int], ...]  # (sequence, tokens of its prompt to prefill now)
    decode: tuple[SeqState, ...]  # sequences that get one token each

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def tokens(self) -> int:
        """Tokens this step computes before any drafts: one per decode row, and each prompt chunk's."""
        return len(self.decode) + sum(n for _, n in self.prefill)

    def sampling_rows(self) -> list[SeqState]:
        """The rows that sample this step: every decode row, and each prompt whose last chunk is in it."""
        return [*self.decode, *(seq for seq, n in self.prefill if seq.prefilled + n == len(seq.prompt_ids))]

    def sequences(self) -> list[SeqState]:
        """The sequence of each row of ``batch()``: the decode rows, then the prompt chunks."""
        return [*self.decode, *(seq for seq, _ in self.prefill)]

    def batch(self, drafts: Mapping[SeqState, tuple[int, ...]] | None = None) -> StepBatch:
        """The runner's plain rows (built after any media the prompt chunks reach is encoded), each decode row
        with its speculative ``drafts`` (speculative.py)."""
        drafts = drafts or {}
        return StepBatch(tuple(s.decode_row(drafts.get(s, ())) for s in self.decode),
                         tuple(s.prompt_chunk(n) for s, n in self.prefill))

    def without(self, dropped: list[SeqState]) -> StepPlan:
        """This plan less the prompt chunks of ``dropped`` (requests failed before the forward pass)."""
        return StepPlan(tuple(w for w in self.prefill if w[0] not in dropped), self.decode) if dropped else self


PRIORITY_PATIENCE = 32  # times a sequence may be overtaken by later, more urgent arrivals before it goes first


class Scheduler:
    """FIFO admission under ``max_batch`` sequences and the cache budget.

    Each step prefills one chunk of up to ``prefill_rows`` prompts (at most ``prefill_tokens`` tokens in
    all, each prompt at most ``chunk``) and decodes one token for every running sequence. ``step_tokens`` (the
    packed runner's largest graph; 0: none) is the most tokens one step holds, decode and prompt together:
    while prompt tokens wait, the prompts fill it past ``prefill_tokens`` (a step that would be padded to that
    graph computes prompt tokens in the padding instead). With separate prefill and decode calls,
    prompts go first: while prompts wait, up to ``prefill_first`` steps in a row prefill without
    decoding (new requests get their first token sooner; the running ones pause for at most that many
    chunks), then a step decodes too. The AOT engine packs both into one forward, with
    ``prefill_first=0``: decoding never pauses.

    With the allocator's prefix caching, a prompt whose first full blocks are cached shares them and starts
    its prefill after them (always leaving at least its last token to compute); its own full prompt blocks
    are registered once written. With the allocator's parts and ``copy_rows(source, block, rows)`` (the
    runner's: the first ``rows`` K/V rows of block ``source`` copied into ``block``, every layer), the block
    after those is matched part by part too: the cached block whose first parts are the most of it lends
    them, copied into the prompt's own block at admission (or, when nobody uses that block and holding it
    for the copy would leave too few blocks, the block itself becomes the prompt's), and the prefill starts
    after them.

    Priority (``SeqState.priority``, vLLM's convention: lower is more urgent) orders both the line and the
    prompt chunks: more urgent first, then by arrival. Starvation is bounded the way the LoRA window bounds
    it: a sequence that later arrivals have overtaken ``priority_patience`` times (to a slot, or to a prompt
    chunk) goes first from then on, whatever its priority.

    ``max_loras`` (> 0) caps the distinct LoRA adapters among the active sequences (every step then mixes at
    most that many): a waiting request whose adapter would exceed it is passed over by the ones behind it
    that fit, but only ``patience`` times; after that nothing else is admitted until it fits, so it cannot
    starve.

    With a ``window_pool`` (a model with sliding-window layers, window_pool.py), a sequence is admitted only while
    that pool can reserve its blocks too; before each step, each sequence in it gives back the window blocks no
    query reads any more and takes those the step writes. A prefix hit is then shortened to what the window
    pool still holds, and blocks are not lent part by part (their window rows would have to be copied too).
    """

    def __init__(self, allocator: BlockAllocator, max_batch: int, max_waiting: int, *,
                 prefill_rows: int = 1, prefill_tokens: int = 64, chunk: int = 64, step_tokens: int = 0,
                 prefill_first: int = PREFILL_FIRST, max_loras: int = 0, patience: int = 16,
                 priority_patience: int = PRIORITY_PATIENCE,
                 copy_rows: Callable[[int, int, int], None] | None = None,
                 window_pool: WindowPool | None = None, row_tokens: int = 0) -> None:
        self.allocator, self.max_batch, self.max_waiting = allocator, max_batch, max_waiting
        self.window_pool, self.row_tokens = window_pool, row_tokens  # row_tokens: the most a row computes a step
        self.copy_rows = copy_rows if allocator.part_size and window_pool is None else None
        self.max_loras, self.patience = max_loras, patience
        self._passed: dict[SeqState, int] = {}  # waiting sequences held back by max_loras -> times overtaken
        self.priority_patience = priority_patience
        self._arrival: dict[SeqState, int] = {}  # each sequence's place in arrival order
        self._overtaken: dict[SeqState, int] = {}  # times later arrivals went first (to a slot or a chunk)
        self._arrivals = itertools.count()
        self.prefill_rows, self.prefill_tokens, self.chunk = prefill_rows, prefill_tokens, chunk
        self.step_tokens = step_tokens
        self.prefill_first = prefill_first
        self._prefill_streak = 0  # steps in a row that prefilled without decoding
        self.waiting: collections.deque[SeqState] = collections.deque()
        self.prefilling: collections.deque[SeqState] = collections.deque()
        self.running: list[SeqState] = []
        # each sequence's full prompt blocks' hashes and each block's parts' (_hashes_of), from its first try
        self._hashes: dict[SeqState, tuple[list[bytes], list[list[bytes]]]] = {}
        self.prompt_tokens = 0  # prompt tokens admitted (with prefix caching on)
        self.hit_tokens = 0  # of which found in the cache, not prefilled

    def __len__(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.running)

    def add(self, seq: SeqState) -> bool:
        if len(self.waiting) >= self.max_waiting:
            return False
        self.waiting.append(seq)
        self._arrival[seq] = next(self._arrivals)
        return True

    def _urgency(self, seq: SeqState) -> tuple[bool, int, int]:
        """The sort key of the line and of the prompt chunks: overtaken ``priority_patience`` times first, then
        lower ``priority``, then earlier arrival."""
        return self._overtaken.get(seq, 0) < self.priority_patience, seq.priority, self._arrival.get(seq, 0)

    def _went_first(self, seq: SeqState, passed: list[SeqState]) -> None:
        """``seq`` went ahead of ``passed``: each that arrived before it counts one more overtaking."""
        for held in passed:
            if self._arrival.get(held, 0) < self._arrival.get(seq, 0):
                self._overtaken[held] = self._overtaken.get(held, 0) + 1

    def _admit(self) -> None:
        active = {s.adapter for s in (*self.prefilling, *self.running) if s.adapter is not None}
        self.waiting = collections.deque(sorted(self.waiting, key=self._urgency))
        i, admitted = 0, []
        while i < len(self.waiting) and self.active < self.max_batch:
            seq = self.waiting[i]
            if not adapter_fits(seq.adapter, active, self.max_loras):
                self._passed.setdefault(seq, 0)
                i += 1
                continue
            if any(n >= self.patience for held, n in self._passed.items() if held is not seq):
                break  # a held-back request has waited long enough: the others wait for it
            if seq not in self._hashes:  # once per sequence, not at every step it waits for blocks
                self._hashes[seq] = self._hashes_of(seq)
            hashes, parts = self._hashes[seq]
            cached = self._cached(seq, hashes)
            shared: list[int] = []
            if self.window_pool is not None:
                n, shared = self.window_pool.match(hashes, len(cached))
                cached = cached[:n]
                if not self.window_pool.can_admit(seq.capacity):
                    break
            lent = self._lent(seq, parts, len(cached))
            source = lent[0] if lent else None
            # Holding an idle source while it is copied would leave too few blocks: the sequence adopts it.
            adopt = source is not None and not self.allocator.can_allocate(seq.capacity, cached, source)
            if not self.allocator.can_allocate(seq.capacity, cached, source, adopt):
                break  # FIFO: wait for blocks rather than overtaking
            del self.waiting[i]
            for held in itertools.islice(self.waiting, i):  # the ones it overtook
                self._passed[held] += 1
            admitted.append(seq)
            self._passed.pop(seq, None)
            if seq.adapter is not None:
                active.add(seq.adapter)
            # Reserve the whole (prompt + max_new_tokens) up front: no preemption needed mid-generation.
            seq.blocks = self.allocator.allocate(seq.capacity, cached, source, adopt)
            if self.window_pool is not None:
                self.window_pool.admit(seq, seq.capacity, len(cached), shared)
            seq.prefilled = len(cached) * self.allocator.block_size
            if lent:
                if not adopt:
                    self.copy_rows(source, seq.blocks[len(cached)], lent[1])
                    self.allocator.release([source])
                seq.prefilled += lent[1]
            if self.allocator.prefix_caching:
                self.prompt_tokens += len(seq.prompt_ids)
                self.hit_tokens += seq.prefilled
                seq.cached = seq.prefilled
            self.prefilling.append(seq)
        for seq in admitted:  # overtaking is getting a slot before an earlier arrival still waiting
            self._went_first(seq, list(self.waiting))

    def _hashes_of(self, seq: SeqState) -> tuple[list[bytes], list[list[bytes]]]:
        """``seq``'s prompt's full-block hashes and, for its parts, each block's part hashes (none without)."""
        if not self.allocator.prefix_caching:
            return [], []
        adapter, media, size = seq.lora.key if seq.lora else None, seq.media_spans(), self.allocator.block_size
        full = block_hashes(seq.prompt_ids, size, adapter, media)
        part = self.allocator.part_size if self.copy_rows else 0
        return full, part_hashes(seq.prompt_ids, size, part, full, adapter, media)

    def _lent(self, seq: SeqState, parts: list[list[bytes]], cached: int) -> tuple[int, int] | None:
        """(source block, rows) for the block after ``seq``'s ``cached`` shared ones: the cached block whose first
        rows are the most of it, short of the prompt's last token; None if none (or it wants every logprob)."""
        if seq.want_prefill or cached >= len(parts):
            return None
        rows = len(seq.prompt_ids) - 1 - cached * self.allocator.block_size
        return self.allocator.match_part(parts[cached][:rows // self.allocator.part_size])

    def _cached(self, seq: SeqState, hashes: list[bytes]) -> list[int]:
        """The cached blocks ``seq`` may share: the longest cached run of its full prompt blocks, short of its
        last token (computed for its logits); none when it wants every prompt token's logprob."""
        if seq.want_prefill:
            return []
        return self.allocator.match(hashes[:(len(seq.prompt_ids) - 1) // self.allocator.block_size])

    def _register(self, seq: SeqState) -> None:
        """Make ``seq``'s prompt blocks (and their parts) written so far findable by the next prompts."""
        full, parts = self._hashes.get(seq, ((), ()))
        size = self.allocator.block_size
        for digest, block in zip(full[:seq.prefilled // size], seq.blocks):
            self.allocator.register(block, digest)
        if self.window_pool is not None:
            self.window_pool.register(seq, full[:seq.prefilled // size])
        for i, (digests, block) in enumerate(zip(parts, seq.blocks)):
            written = (seq.prefilled - i * size) // self.allocator.part_size
            for digest in digests[:max(written, 0)]:
                self.allocator.register_part(block, digest)

    def plan(self) -> StepPlan:
        for seq in self.prefilling:
            self._register(seq)
        self._admit()
        work, budget = [], max(self.prefill_tokens, self.step_tokens - len(self.running))
        self.prefilling = collections.deque(sorted(self.prefilling, key=self._urgency))
        for seq in itertools.islice(self.prefilling, self.prefill_rows):
            n = min(self.chunk, len(seq.prompt_ids) - seq.prefilled, budget)
            if n <= 0:
                break
            work.append((seq, n))
            budget -= n
        for seq, _ in work:
            self._went_first(seq, list(itertools.islice(self.prefilling, len(work), None)))
        self._advance_windows(work)
        if work and self.running and self._prefill_streak < self.prefill_first:
            self._prefill_streak += 1
            return StepPlan(tuple(work), ())
        self._prefill_streak = 0
        return StepPlan(tuple(work), tuple(self.running))

    def _advance_windows(self, work: list[tuple[SeqState, int]]) -> None:
        """The window pool's blocks of this step's sequences: each prompt chunk's, and each running sequence's
        for its next ``row_tokens`` positions (its token and any drafts)."""
        if self.window_pool is None:
            return
        for seq, n in work:
            self.window_pool.advance(seq, seq.prefilled, seq.prefilled + n)
        for seq in self.running:
            start = seq.length - 1
            self.window_pool.advance(seq, start, min(start + max(self.row_tokens, 1), seq.capacity))

    def prefill_done(self, seq: SeqState) -> None:
        self._register(seq)
        self.prefilling.remove(seq)
        self.running.append(seq)

    def finish(self, seq: SeqState) -> None:
        """Drop a sequence wherever it is and free its cache blocks."""
        for pool in (self.running, self.prefilling, self.waiting):
            if seq in pool:
                pool.remove(seq)
        self._hashes.pop(seq, None)
        self._passed.pop(seq, None)
        self._arrival.pop(seq, None)
        self._overtaken.pop(seq, None)
        self.allocator.release(seq.blocks)
        if self.window_pool is not None:
            self.window_pool.finish(seq)
        seq.close()

    def by_priority(self) -> dict[int, dict[str, int]]:
        """Requests per priority: ``waiting`` (queued or still prefilling) and ``running`` (for /info, from
        another thread: each pool is copied in one C call, under the GIL, before it is counted)."""
        counts: dict[int, dict[str, int]] = {}
        for pool, where in ((self.waiting, "waiting"), (self.prefilling, "waiting"), (self.running, "running")):
            for seq in tuple(pool):
                counts.setdefault(seq.priority, {"waiting": 0, "running": 0})[where] += 1
        return dict(sorted(counts.items()))

    def queue_load(self) -> dict[str, Any]:
        """What a gateway reads (service/loads.py, vllm:lora_requests_info), from another thread like
        ``by_priority``: prompt tokens still to compute of the requests queued or prefilling, and the LoRA adapters
        of the running and of the waiting requests."""
        waiting, running = (*tuple(self.waiting), *tuple(self.prefilling)), tuple(self.running)
        return {"waiting_prompt_tokens": sum(max(len(s.prompt_ids) - s.prefilled, 0) for s in waiting),
                "running_adapters": sorted({s.adapter for s in running if s.adapter is not None}),
                "waiting_adapters": sorted({s.adapter for s in waiting if s.adapter is not None})}

    def all(self) -> list[SeqState]:
        return [*self.running, *self.prefilling, *self.waiting]
