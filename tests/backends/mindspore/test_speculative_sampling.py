"""Speculative decoding keeps the sampled distribution (docs/speculative.md "Sampling is standard speculative
sampling"), on the tiny model: Pearson's chi-square test of homogeneity between the token histograms of
sampled generations with speculation on and off (different seeds, so the two samples are independent), at
each generated position, at a stated significance; the same test rejects a deliberately biased verifier
(a draft the model ranks first is accepted outright: the classic greedy-verification-while-sampling bug), so it
can fail. Both with prompt-lookup drafts and with a draft model's. And a seed gives the same text, with
speculation on or off and again with the same draft settings."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from backends.mindspore.engine.engine import Engine
from backends.mindspore.engine.sequence import SeqState
from backends.settings import EngineConfig, SpeculationSettings
from backends.types import GenerationResult, RequestParams
from tests.support.chi_square import chi2_sf, homogeneity

# n-grams of 1..2, fixed k: the tiny model's sampled text drafts often (about one verify row per 1.5 tokens)
CONFIG = EngineConfig(max_seq_len=128, max_input_tokens=100, max_batch_size=8, max_iter_times=64, block_size=16,
                      prefill_chunk=16, window_buckets=(128,), batch_buckets=(1, 4, 16),
                      speculation=SpeculationSettings(max_draft=4, ngram_min=1, ngram_max=2, adaptive=False))
PROMPT = "one two three four five one two three four five one two three four five one two three"
NEW = 10  # tokens per generation
SAMPLES = 1500  # generations per arm
# top_k 2: each position a choice among few tokens, so few bins and a strong test per generation
PARAMS = RequestParams(max_new_tokens=NEW, do_sample=True, top_k=2, ignore_eos=True)
# The family's significance: the chance that a correct implementation fails the test at some position is at
# most ALPHA (Bonferroni over the NEW - 1 positions drafts can reach: the first token comes from the prompt).
ALPHA = 1e-3
POSITIONS = range(1, NEW)


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def engine(request, tiny_model_dir):
    """Prompt lookup, or the tiny model drafting for itself (its drafts: its greedy tokens)."""
    config = CONFIG
    if request.param == "draft_model":
        config = replace(CONFIG, speculation=replace(CONFIG.speculation, draft_model=tiny_model_dir))
    with Engine(tiny_model_dir, config) as eng:
        yield eng


def generate(engine: Engine, seeds: range, speculate: bool) -> list[GenerationResult]:
    """One generation per seed, in waves of 8 (a wave leaves the step room for drafts)."""
    out: list[GenerationResult] = []
    for at in range(0, len(seeds), 8):
        handles = [engine.submit(PROMPT, RequestParams(**{**_fields(PARAMS), "seed": s, "speculate": speculate}))
                   for s in seeds[at:at + 8]]
        out += [h.result(timeout=300) for h in handles]
    return out


def _fields(params: RequestParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def histogram(results: list[GenerationResult], position: int) -> Counter:
    return Counter(r.tokens[position].id for r in results)


def worst_position(a: list[GenerationResult], b: list[GenerationResult]):
    """The position whose histograms differ the most (the smallest p-value) and its test."""
    tests = {j: homogeneity(histogram(a, j), histogram(b, j)) for j in POSITIONS}
    return min(tests.items(), key=lambda kv: kv[1].p_value)


@pytest.fixture(scope="module")
def plain(engine):
    """The reference sample: speculation off, seeds 1_000_000 + i (independent of the arms below)."""
    return generate(engine, range(1_000_000, 1_000_000 + SAMPLES), speculate=False)


def test_speculative_sampling_keeps_the_token_distribution(engine, plain):
    before = engine.speculator.stats.accepted, engine.speculator.stats.verify_steps
    speculative = generate(engine, range(SAMPLES), speculate=True)
    accepted = engine.speculator.stats.accepted - before[0]
    verified = engine.speculator.stats.verify_steps - before[1]
    assert verified > SAMPLES and accepted > SAMPLES // 2, "drafts were verified and accepted while sampling"
    position, test = worst_position(speculative, plain)
    assert test.p_value >= ALPHA / len(POSITIONS), (
        f"position {position}: the token histograms with and without speculation differ "
        f"(chi-square {test.statistic:.1f}, df {test.df}, p {test.p_value:.2g})")


def test_a_biased_verifier_is_rejected(engine, plain, monkeypatch):
    """The same test on an engine whose verifier accepts a draft the model ranks first without sampling it
    (the draft is forced where it is the argmax): the histograms move, and the test rejects at ALPHA."""
    pending: dict[SeqState, list[int]] = {}
    advance_row, advance_seq = Engine._advance, SeqState.advance

    def biased_row(self, seq, out, masks):
        pending[seq] = list(out.drafts)
        try:
            advance_row(self, seq, out, masks)
        finally:
            pending.pop(seq, None)

    def biased_seq(self, logits):
        drafts = pending.get(self)
        if drafts:
            draft = drafts.pop(0)
            if int(np.argmax(logits)) == draft:
                logits = np.array(logits, copy=True)
                logits[draft] = 1e4  # chosen whatever the RNG draws
        return advance_seq(self, logits)

    monkeypatch.setattr(Engine, "_advance", biased_row)
    monkeypatch.setattr(SeqState, "advance", biased_seq)
    biased = generate(engine, range(SAMPLES), speculate=True)
    position, test = worst_position(biased, plain)
    assert test.p_value < ALPHA / len(POSITIONS), f"the biased verifier went unnoticed: {test}"


def test_a_seed_gives_the_same_text_on_and_off_and_again(engine):
    seeds = range(40, 56)
    on, off, again = (generate(engine, seeds, speculate) for speculate in (True, False, True))
    ids = [[[t.id for t in r.tokens] for r in rs] for rs in (on, off, again)]
    assert ids[0] == ids[1] == ids[2]
    assert [r.generated_text for r in on] == [r.generated_text for r in off]
    assert len({tuple(x) for x in ids[0]}) > 8, "the seeds give different texts"


@pytest.mark.parametrize("x, df, p", [(3.841, 1, 0.05), (6.635, 1, 0.01), (18.307, 10, 0.05),
                                      (29.588, 10, 0.001), (124.342, 100, 0.05), (2.0, 2, np.exp(-1.0))])
def test_chi_square_p_values_match_the_tables(x, df, p):
    """chi2_sf against printed critical values (and the closed form exp(-x/2) at df 2)."""
    assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3)


def test_homogeneity_pools_small_bins():
    same = homogeneity(Counter({1: 50, 2: 50, 3: 1}), Counter({1: 50, 2: 50, 4: 1}))
    assert same.bins == 2 and same.statistic == 0.0 and same.p_value == 1.0
    apart = homogeneity(Counter({1: 90, 2: 10}), Counter({1: 10, 2: 90}))
    assert apart.p_value < 1e-20
