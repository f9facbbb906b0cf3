"""Prompt-lookup (n-gram) speculative decoding (the reference server's memory_decoding): each sequence drafts the
tokens that followed the most recent earlier occurrence of its longest matching suffix, in its prompt and its
own output (``NgramIndex``), with a draft length that follows its acceptance (``Drafter``); ``Speculator`` hands
out a step's drafts within the runner's budget (from the n-gram index, or from a draft model: draft_model.py;
a grammar row's cut where its grammar refuses) and counts what was drafted and accepted.

Verification is the engine's: a decode row carries its drafts through the same packed forward, every position's
logits come back, and each draft is accepted while it equals the token the sequence's own chooser picks from the
logits before it. The kernels are row-deterministic, so those logits are the bits of one-at-a-time decoding and
the output (ids, logprobs, seeded samples) is exactly the plain run's. docs/speculative.md."""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from backends.settings import SpeculationSettings

if TYPE_CHECKING:
    from backends.grammar import GrammarState

log = logging.getLogger("mindserve.engine")

# A draft position costs a fraction of a plain step (its row of the forward pass, most of it the head's): on Gemma 3
# 270M (a quiet box, one row) 1 + 1, 1 + 3, 1 + 7 tokens cost 1.08, 1.32, 1.89 plain steps, 0.08-0.13 of a step a
# draft (docs/speculative.md). Drafts pay for themselves while more than that share of them is accepted, so drafting
# pauses a little above the dearest break-even, judged over enough verify steps that a miss between copies does not.
PAUSE_WINDOW = 8  # verify steps whose acceptance decides a pause
PAUSE_BELOW = 0.15  # acceptance rate over the window below which drafting pauses (the break-even above)
FIRST_PAUSE, LONGEST_PAUSE = 16, 512  # generated tokens without drafting; each pause in a row doubles


class NgramIndex:
    """A sequence's tokens and, for each n in [n_min, n_max], where the latest n-gram that has a following
    token was followed from: ``propose`` tries the longest suffix first."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        for tid in tokens:
            self.tokens.append(tid)
            m = len(self.tokens)  # the n-grams ending at m - 1 are now followed by the token at m - 1
            for n, after in self._after.items():
                if m - 1 >= n:
                    after[tuple(self.tokens[m - 1 - n:m - 1])] = m - 1

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        m = len(self.tokens)
        for n in range(min(self.n_max, m), self.n_min - 1, -1):
            at = self._after[n].get(tuple(self.tokens[m - n:]))
            if at is not None:
                return self.tokens[at:at + k]
        return []


@dataclass(slots=True)
class DraftCache:
    """A sequence's place in a draft model's K/V cache (draft_model.py): ``fed`` the tokens at positions 0..
    whose K/V it holds, of which the first ``sure`` are the sequence's own (the rest were drafts)."""

    fed: list[int] = field(default_factory=list)
    sure: int = 0

    def pending(self, tokens: Sequence[int]) -> list[int]:
        """Forget the drafts ``tokens`` (the sequence now) did not take; the tokens still to feed: at least the
        last one, whose logits give the first draft (fed again if a draft already put it there)."""
        common = self.sure
        while common < min(len(self.fed), len(tokens) - 1) and self.fed[common] == tokens[common]:
            common += 1
        del self.fed[common:]
        self.sure = len(tokens)
        return list(tokens[common:])


@dataclass(slots=True)
class Drafter:
    """One sequence's drafting: its index, its draft length ``k`` and, when adaptive, its pauses. Adaptive: k
    doubles after a fully accepted draft and drops to one more than the accepted count otherwise; when fewer
    than PAUSE_BELOW of the drafts of the last PAUSE_WINDOW verify steps are accepted, drafting pauses for a
    number of generated tokens that doubles with each pause until a draft is accepted whole (so a sequence
    with nothing to copy soon costs nothing but the lookup)."""

    settings: SpeculationSettings
    index: NgramIndex
    k: int
    resume_at: int = 0  # generated tokens before which it does not draft
    pause: int = FIRST_PAUSE
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=PAUSE_WINDOW))
    cache: DraftCache = field(default_factory=DraftCache)  # with a draft model: what its cache holds

    @classmethod
    def of(cls, settings: SpeculationSettings) -> Drafter:
        k = max(1, settings.max_draft // 2) if settings.adaptive else settings.max_draft
        return cls(settings, NgramIndex(settings.ngram_min, settings.ngram_max), k)

    def propose(self, prompt: Sequence[int], generated: Sequence[int], limit: int) -> list[int]:
        """Up to min(k, ``limit``) draft tokens after ``prompt`` + ``generated`` (none while paused)."""
        have, n_prompt = len(self.index.tokens), len(prompt)
        if have < n_prompt:
            self.index.extend(prompt[have:])
        self.index.extend(generated[max(0, len(self.index.tokens) - n_prompt):])
        wanted = self.wanted(len(generated), limit)
        return self.index.propose(wanted) if wanted else []

    def wanted(self, generated: int, limit: int) -> int:
        """Tokens to draft now, at ``generated`` tokens: min(k, ``limit``), none while paused."""
        return 0 if limit <= 0 or generated < self.resume_at else min(self.k, limit)

    def record(self, drafted: int, accepted: int, generated: int) -> None:
        """A verify step's outcome: ``accepted`` of ``drafted`` drafts, the sequence at ``generated`` tokens."""
        if not self.settings.adaptive:
            return
        self.k = min(2 * self.k, self.settings.max_draft) if accepted == drafted else max(1, accepted + 1)
        self.recent.append((drafted, accepted))
        tried = sum(d for d, _ in self.recent)
        if len(self.recent) == PAUSE_WINDOW and sum(a for _, a in self.recent) < PAUSE_BELOW * tried:
            self.resume_at = generated + self.pause
            self.pause = min(2 * self.pause, LONGEST_PAUSE)
            self.recent.clear()
        elif accepted == drafted:
            self.pause = FIRST_PAUSE


class Drafting(Protocol):
    """What the speculator reads of a sequence (``SeqState``)."""

    prompt_ids: list[int]
    generated: list[int]
    max_new_tokens: int
    drafter: Drafter | None
    grammar: GrammarState | None


class DraftProposer(Protocol):
    """A draft model (``draft_model.DraftModel``): greedy drafts of the asked length for each sequence."""

    def propose(self, wants: Mapping[Drafting, int]) -> dict[Drafting, list[int]]: ...

    def info(self) -> dict: ...


@dataclass(slots=True)
class SpeculationStats:
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    verify_steps: int = 0  # decode rows that carried drafts
    verified_tokens: int = 0  # tokens those rows emitted (accepted drafts + the one each row always gives)

    def describe(self) -> dict:
        return {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "verify_steps": self.verify_steps,
                "tokens_per_verify_step": self.verified_tokens / self.verify_steps if self.verify_steps else 0.0}


class Speculator:
    """The engine's speculation: which sequences draft (``drafter``), a step's drafts within the runner's
    ``draft_budget`` (``propose``), and the counts (``record``, ``info``). ``active`` is False when it is off
    or the runner does not speculate (the stock-op split step)."""

    def __init__(self, settings: SpeculationSettings, runner_speculates: bool,
                 model: DraftProposer | None = None) -> None:
        self.settings = settings
        self.active = settings.enabled and runner_speculates
        self.model = model  # plugin_type draft_model: it proposes instead of the n-gram index
        self._drafts = self._ngram_drafts if model is None else self._model_drafts  # the strategy, chosen once
        self.stats = SpeculationStats()

    def drafter(self, wanted: bool) -> Drafter | None:
        """A new sequence's drafter, or None: speculation off, or the request opted out (``wanted`` False)."""
        return Drafter.of(self.settings) if self.active and wanted else None

    def propose(self, seqs: Sequence[Drafting], budget: int,
                fit: Callable[[int], int] = lambda wanted: wanted) -> dict[Drafting, tuple[int, ...]]:
        """This step's drafts of the decode rows ``seqs``, at most ``budget`` tokens in all, then cut to
        ``fit(wanted)`` (the runner's ``fit_drafts``) by shortening the longest; a sequence drafts at most one
        token fewer than it may still generate (the verify step gives one more), and a grammar row's draft stops
        before the first token its grammar refuses (``GrammarState.valid_prefix``: it could not be accepted)."""
        out = self._drafts(seqs, budget)
        for seq, drafts in out.items():
            if seq.grammar is not None:
                del drafts[seq.grammar.valid_prefix(drafts):]
        out = {seq: d for seq, d in out.items() if d}
        wanted = sum(len(d) for d in out.values())
        for _ in range(wanted - fit(wanted) if out else 0):
            max(out.values(), key=len).pop()
        return {seq: tuple(d) for seq, d in out.items() if d}

    def _ngram_drafts(self, seqs: Sequence[Drafting], budget: int) -> dict[Drafting, list[int]]:
        out: dict[Drafting, list[int]] = {}
        for seq in seqs:
            if budget <= 0:
                break
            if seq.drafter is not None:
                out[seq] = seq.drafter.propose(seq.prompt_ids, seq.generated, min(budget, _room(seq)))
                budget -= len(out[seq])
        return out

    def _model_drafts(self, seqs: Sequence[Drafting], budget: int) -> dict[Drafting, list[int]]:
        """The draft model's proposals, each row's length decided first (its k, its room, the budget)."""
        wants: dict[Drafting, int] = {}
        for seq in seqs:
            if budget <= 0:
                break
            if seq.drafter is not None and (n := seq.drafter.wanted(len(seq.generated), min(budget, _room(seq)))):
                wants[seq] = n
                budget -= n
        if not wants:
            return {}
        try:
            return self.model.propose(wants)
        except Exception:  # drafts only speed decoding up: a failed draft call costs this step's, not a request
            log.exception("the draft model failed; this step decodes without drafts")
            for seq in wants:
                seq.drafter.cache = DraftCache()  # what its draft cache holds is unknown now: fed again
            return {}

    def record(self, seq: Drafting, drafted: int, accepted: int, emitted: int) -> None:
        s = self.stats
        s.drafted, s.accepted, s.verify_steps = s.drafted + drafted, s.accepted + accepted, s.verify_steps + 1
        s.verified_tokens += emitted
        seq.drafter.record(drafted, accepted, len(seq.generated))

    def info(self) -> dict:
        """What /info reports: the settings and the counts."""
        st = self.settings
        model = self.model.info() if self.model is not None else {}
        return {"enabled": self.active, "method": st.method, "max_draft": st.max_draft, "ngram_min": st.ngram_min,
                "ngram_max": st.ngram_max, "adaptive": st.adaptive, **model, **self.stats.describe()}


def _room(seq: Drafting) -> int:
    """Draft tokens ``seq`` may carry: one fewer than it may still generate (the verify step gives one more)."""
    return seq.max_new_tokens - len(seq.generated) - 1
