"""Prompt-lookup drafting (speculative.py): the n-gram index, the adaptive draft length and pauses, the step's
draft budget. Pure logic: no model."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from backends.mindspore.engine.speculative import (FIRST_PAUSE, PAUSE_BELOW, PAUSE_WINDOW, Drafter, NgramIndex,
                                                   Speculator)
from backends.settings import SpeculationSettings


def index(tokens, n_min=1, n_max=3) -> NgramIndex:
    ix = NgramIndex(n_min, n_max)
    ix.extend(tokens)
    return ix


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 4, 5, 1, 2], 3, [3, 4, 5]),  # suffix "1 2" found at the start
    ([1, 2, 3, 4, 5, 1, 2], 1, [3]),
    ([1, 2, 3, 9, 2, 3], 4, [9, 2, 3]),  # "2 3" -> what followed it, up to the end
    ([7, 8, 9], 3, []),  # nothing repeats
    ([5, 5], 3, [5]),  # "5" followed by "5"
    ([1, 2, 9, 3, 2, 8, 1, 2], 2, [9, 3]),  # the longest suffix wins over the latest "2"
    ([1, 4, 1, 5, 1], 2, [5, 1]),  # the latest occurrence of "1"
])
def test_proposal_follows_the_longest_then_latest_match(tokens, k, want):
    assert index(tokens).propose(k) == want


def test_the_n_range_bounds_the_lookup():
    assert index([1, 2, 3, 4, 2], n_min=2, n_max=3).propose(3) == []  # only a 1-gram matches
    assert index([1, 2, 3, 4, 2], n_min=1, n_max=3).propose(3) == [3, 4, 2]


def test_incremental_extension_equals_one_extend():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    whole, steps = index(tokens), NgramIndex(1, 3)
    for t in tokens:
        steps.extend([t])
    assert steps._after == whole._after and steps.propose(4) == whole.propose(4)


def test_drafter_indexes_prompt_then_output_and_respects_the_limit():
    d = Drafter.of(SpeculationSettings(max_draft=8, adaptive=False))
    prompt = [10, 11, 12, 13, 14, 15]
    assert d.propose(prompt, [], 8) == []
    assert d.propose(prompt, [10, 11], 8) == [12, 13, 14, 15, 10, 11]
    assert d.propose(prompt, [10, 11, 12], 2) == [13, 14]
    assert d.propose(prompt, [10, 11, 12], 0) == []
    assert d.index.tokens == prompt + [10, 11, 12]


def test_adaptive_k_doubles_on_full_acceptance_and_drops_after_a_miss():
    d = Drafter.of(SpeculationSettings(max_draft=8))
    assert d.k == 4
    d.record(4, 4, 10)
    assert d.k == 8
    d.record(8, 8, 20)
    assert d.k == 8  # capped
    d.record(8, 2, 23)
    assert d.k == 3
    d.record(3, 0, 24)
    assert d.k == 1


def test_low_acceptance_pauses_drafting_for_a_doubling_number_of_tokens():
    d = Drafter.of(SpeculationSettings(max_draft=4, ngram_min=1))
    prompt = [1, 2, 1, 2, 1, 2]
    for i in range(PAUSE_WINDOW):
        assert d.propose(prompt, [1] * (i + 1), 4)  # a match: it drafts
        d.record(2, 0, i + 1)
    assert d.resume_at == PAUSE_WINDOW + FIRST_PAUSE
    assert d.propose(prompt, [1] * (PAUSE_WINDOW + 1), 4) == []  # paused
    assert d.propose(prompt, [1] * d.resume_at, 4)  # resumed
    for _ in range(PAUSE_WINDOW):
        d.record(2, 0, d.resume_at)
    assert d.pause == 4 * FIRST_PAUSE  # the next pause will be longer still
    d.record(2, 1, d.resume_at)
    assert d.pause == 4 * FIRST_PAUSE  # a half-accepted draft does not reset it
    d.record(2, 2, d.resume_at)
    assert d.pause == FIRST_PAUSE  # a whole one does


@pytest.mark.parametrize("outcomes, pauses", [
    # (drafted, accepted) of successive verify steps; PAUSE_WINDOW = 8 of them decide, at PAUSE_BELOW = 0.15
    ([(1, 0)] * 8, True),  # nothing accepted: drafts only cost
    ([(1, 0)] * 7, False),  # not yet a whole window
    ([(7, 1)] + [(1, 0)] * 7, True),  # 1 of 14 = 0.07
    ([(7, 2)] + [(1, 0)] * 7, True),  # 2 of 14 = 0.143: just below
    ([(6, 3)] + [(2, 0)] * 7, False),  # 3 of 20 = 0.15: at the break-even, not below it
    ([(7, 3)] + [(1, 0)] * 7, False),  # 3 of 14 = 0.21: above the break-even, it goes on
    ([(7, 6)] + [(7, 0)] * 7, True),  # 6 of 56 = 0.107
    ([(7, 7), (7, 0)] * 4, False),  # copying with a miss between: 28 of 56
])
def test_drafting_pauses_only_below_the_break_even_acceptance(outcomes, pauses):
    assert (PAUSE_WINDOW, PAUSE_BELOW) == (8, 0.15)  # the table's figures are for these
    d = Drafter.of(SpeculationSettings(max_draft=8))
    for i, (drafted, accepted) in enumerate(outcomes):
        d.record(drafted, accepted, 10 + i)
    assert (d.resume_at > 0) is pauses


def test_a_fixed_drafter_never_pauses():
    d = Drafter.of(SpeculationSettings(max_draft=3, adaptive=False))
    for _ in range(3 * PAUSE_WINDOW):
        d.record(3, 0, 1)
    assert d.k == 3 and d.resume_at == 0


@dataclass(eq=False)
class Seq:  # what Speculator reads of a SeqState
    prompt_ids: list[int]
    generated: list[int]
    max_new_tokens: int
    drafter: Drafter | None
    grammar: object = None


class Grammar:  # a grammar that takes the tokens below ``limit`` only (GrammarState.valid_prefix)
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def valid_prefix(self, tokens) -> int:
        return next((i for i, t in enumerate(tokens) if t >= self.limit), len(tokens))


def seq(prompt, generated, max_new=100, drafter=True, settings=SpeculationSettings(max_draft=4, adaptive=False)):
    return Seq(prompt, generated, max_new, Drafter.of(settings) if drafter else None)


def test_step_drafts_share_the_budget_and_stop_short_of_the_length_limit():
    spec = Speculator(SpeculationSettings(max_draft=4, adaptive=False), True)
    a, b, c = seq([1, 2, 3, 4, 5, 6, 1], [2]), seq([1, 2, 3, 4, 5, 6, 1], [2]), seq([1, 2, 3, 4, 5, 6, 1], [2])
    out = spec.propose([a, b, c], 6)
    assert out == {a: (3, 4, 5, 6), b: (3, 4)}  # c: the budget is spent
    near = seq([1, 2, 3, 4, 5, 6, 1], [2], max_new=3)  # 2 more tokens to go: one draft, then one corrected token
    assert spec.propose([near], 16) == {near: (3,)}
    assert spec.propose([seq([1, 2, 1], [2], drafter=False)], 16) == {}


def test_who_drafts():
    on, off = SpeculationSettings(max_draft=4), SpeculationSettings()
    assert Speculator(on, True).drafter(True) is not None
    assert Speculator(on, True).drafter(False) is None  # the request opted out
    assert Speculator(on, False).drafter(True) is None  # the runner does not speculate
    assert Speculator(off, True).drafter(True) is None
    assert Speculator(on, False).info()["enabled"] is False


def test_a_grammar_rows_draft_stops_before_the_first_token_it_refuses():
    spec = Speculator(SpeculationSettings(max_draft=4, adaptive=False), True)
    cut, whole = seq([1, 2, 3, 4, 5, 6, 1], [2]), seq([1, 2, 3, 4, 5, 6, 1], [2])
    cut.grammar, whole.grammar = Grammar(5), Grammar(100)  # cut's grammar refuses 5: drafts 3 4, not 5 6
    refused = seq([1, 2, 9, 1], [2])
    refused.grammar = Grammar(5)  # refuses the first draft: no draft at all
    assert spec.propose([cut, whole, refused], 16) == {cut: (3, 4), whole: (3, 4, 5, 6)}


def test_counts():
    spec = Speculator(SpeculationSettings(max_draft=4), True)
    s = seq([1, 2, 1], [2], settings=SpeculationSettings(max_draft=4))
    spec.record(s, 4, 3, 4)
    spec.record(s, 2, 0, 1)
    info = spec.info()
    assert (info["drafted_tokens"], info["accepted_tokens"], info["verify_steps"]) == (6, 3, 2)
    assert info["acceptance_rate"] == pytest.approx(0.5) and info["tokens_per_verify_step"] == pytest.approx(2.5)


def test_drafts_are_cut_to_what_fits_by_shortening_the_longest():
    spec = Speculator(SpeculationSettings(max_draft=4, adaptive=False), True)
    a, b = seq([1, 2, 3, 4, 5, 6, 1], [2]), seq([7, 8, 9, 1, 2, 7], [8])
    out = spec.propose([a, b], 16, fit=lambda wanted: wanted - 3)  # a wants 3 4 5 6, b 9 1 2 7
    assert out == {a: (3, 4), b: (9, 1, 2)}
    assert spec.propose([a], 16, fit=lambda wanted: 0) == {}


@pytest.mark.parametrize("tokens, drafts, want", [
    (1, 8, 7),  # 1 + 7 = 8 tokens: the size-8 graph, not the size-16 one for 9
    (1, 1, 1),
    (1, 2, 1),  # 3 tokens would run the size-4 graph; 2 fill the size-2 one
    (3, 1, 1),  # 3 decode rows run the size-4 graph anyway: one draft rides in its padding
    (3, 6, 5),  # up to 8
    (65, 20, 15),  # a 64-token chunk + 1 decode row runs the 80 graph: 15 drafts fill it, no more exists
    (8, 0, 0),
])
def test_packed_step_sends_drafts_up_to_a_compiled_size(tokens, drafts, want):
    from types import SimpleNamespace

    from backends.mindspore.runners.packed import PackedRunner

    runner = SimpleNamespace(shapes=SimpleNamespace(prefill_sizes=(1, 2, 4, 8, 16, 32, 64, 80)))
    assert PackedRunner.fit_drafts(runner, tokens, drafts) == want


def test_a_failing_draft_model_costs_the_steps_drafts_only():
    class Failing:
        def propose(self, wants):
            raise RuntimeError("draft forward failed")

    spec = Speculator(SpeculationSettings(max_draft=4, adaptive=False), True, Failing())
    s = seq([1, 2, 3], [4])
    s.drafter.cache.fed.extend([1, 2, 3])
    assert spec.propose([s], 8) == {}
    assert s.drafter.cache.fed == []  # fed again from the start next time


def test_the_draft_model_is_asked_for_each_rows_length_within_the_budget():
    class Recording:
        def propose(self, wants):
            self.wants = dict(wants)
            return {q: [7] * n for q, n in wants.items()}

    model = Recording()
    spec = Speculator(SpeculationSettings(max_draft=4, adaptive=False), True, model)
    a, b, near = seq([1], [2]), seq([1], [2]), seq([1], [2], max_new=3)
    assert spec.propose([a, b, near], 6) == {a: (7, 7, 7, 7), b: (7, 7)}  # the budget is spent before near
    assert model.wants == {a: 4, b: 2}
    assert spec.propose([near], 6) == {near: (7,)}  # one token fewer than it may still generate

