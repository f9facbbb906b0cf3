"""Logits processors, the per-request chooser and the watermark detector (TGI-style tables)."""
import math
import warnings

import numpy as np
import pytest

from backends.logit_processors import RepetitionPenalty, Temperature, TopK, TopP, TypicalP, build_processors
from backends.sampling import NextTokenChooser, _inverse_cdf, choose_batch, vocab_log_softmax
from backends.types import SamplingParams
from backends.watermark import Watermark, green_list, watermark_z_score

NEG = -np.inf


def params(**overrides) -> SamplingParams:
    base = dict(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, typical_p=1.0,
                repetition_penalty=1.0, watermark=False, seed=42)
    return SamplingParams(**{**base, **overrides})


def f64(values) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def fake_model_logits(prev_token: int, vocab: int, scale: float = 1.0) -> np.ndarray:
    """A fixed pseudo-random next-token distribution for each previous token."""
    return (np.random.default_rng(prev_token).standard_normal(vocab) * scale).astype(np.float32)


def generate(chooser: NextTokenChooser, steps: int, vocab: int = 1000, start: int = 1) -> list[int]:
    ids = [start]
    for _ in range(steps):
        ids.append(chooser.choose(fake_model_logits(ids[-1], vocab), ids)[0])
    return ids[1:]


# --- independent reference formulas (full sorts, written from the HF definitions) ---

def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_top_p_keep(logits: np.ndarray, p: float) -> set[int]:
    probs = softmax(logits)
    order = np.lexsort((np.arange(logits.size), -logits))
    kept, before = set(), 0.0
    for i in order:
        if kept and before >= p:
            break
        kept.add(int(i))
        before += probs[i]
    return kept


def ref_typical_keep(logits: np.ndarray, mass: float) -> set[int]:
    logp = np.log(softmax(logits))
    probs = np.exp(logp)
    shifted = np.abs(-logp - (-(probs * logp).sum()))
    order = np.argsort(shifted, kind="stable")
    last = min(int((np.cumsum(probs[order]) < mass).sum()), logits.size - 1)
    return set(np.flatnonzero(shifted <= shifted[order[last]]).tolist())


def kept(logits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(logits > NEG).tolist())


# --- processors on hand-made logits ---

@pytest.mark.parametrize(
    "penalty, logits, history, expected",
    [
        (2.0, [2.0, -2.0, 0.5, 0.0, 3.0], [0, 1, 3, 0], [1.0, -4.0, 0.5, 0.0, 3.0]),
        (0.5, [2.0, -2.0, 0.5, 0.0, 3.0], [0, 1, 3, 0], [4.0, -1.0, 0.5, 0.0, 3.0]),
        (1.5, [3.0, -3.0], [], [3.0, -3.0]),
        (4.0, [8.0, 8.0, -1.0], [2, 1], [8.0, 2.0, -4.0]),
    ],
)
def test_repetition_penalty(penalty, logits, history, expected):
    out = RepetitionPenalty(penalty)(f64(logits), np.array(history, dtype=np.int64))
    np.testing.assert_allclose(out, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_repetition_penalty_past_the_float_range_stays_finite_and_warns_nothing(dtype):
    big = np.finfo(dtype).max / 4
    logits = np.array([big, -big, -1.0, 5.0], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = RepetitionPenalty(8.0)(logits, np.array([0, 1, 2], dtype=np.int64))
    assert out.tolist() == [big / 8, np.finfo(dtype).min, -8.0, 5.0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_tiny_repetition_penalty_and_temperature_stay_finite_and_warn_nothing(dtype):
    """1e-323 (a valid penalty: > 0) once gave inf logits, then NaN weights and a 500."""
    logits = np.array([5.0, -5.0, 1.0, NEG], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = RepetitionPenalty(1e-323)(logits, np.array([0, 1], dtype=np.int64))
        assert out[0] == np.finfo(dtype).max and -1e-300 < out[1] <= 0 and out.tolist()[2:] == [1.0, NEG]
        out = Temperature(1e-5)(out, np.array([]))
    assert out[0] == np.finfo(dtype).max and out[2] == dtype(1.0) / dtype(1e-5) and out[3] == NEG


@pytest.mark.parametrize("temperature, logits, expected", [
    (0.5, [1.0, -2.0, 3.0], [2.0, -4.0, 6.0]),
    (2.0, [1.0, -2.0, NEG], [0.5, -1.0, NEG]),
])
def test_temperature(temperature, logits, expected):
    np.testing.assert_allclose(Temperature(temperature)(f64(logits), np.array([])), expected)


@pytest.mark.parametrize(
    "k, logits, expected",
    [
        (2, [1.0, 5.0, 3.0, 4.0, 2.0], [NEG, 5.0, NEG, 4.0, NEG]),
        (1, [1.0, 5.0, 3.0, 4.0, 2.0], [NEG, 5.0, NEG, NEG, NEG]),
        (4, [1.0, 5.0, 3.0, 4.0, 2.0], [NEG, 5.0, 3.0, 4.0, 2.0]),
        (5, [1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0]),
        (9, [1.0, 5.0], [1.0, 5.0]),
        (1, [1.0, 3.0, 3.0, 2.0], [NEG, 3.0, 3.0, NEG]),  # ties with the k-th stay (HF)
    ],
)
def test_top_k(k, logits, expected):
    np.testing.assert_array_equal(TopK(k)(f64(logits), np.array([])), expected)


# probabilities 0.1, 0.5, 0.15, 0.25: descending order is ids 1, 3, 2, 0
TOP_P_PROBS = [0.1, 0.5, 0.15, 0.25]


@pytest.mark.parametrize("p, expected", [
    (1e-6, {1}), (0.45, {1}), (0.55, {1, 3}), (0.74, {1, 3}), (0.8, {1, 3, 2}), (0.95, {0, 1, 2, 3}),
])
def test_top_p_by_hand(p, expected):
    out = TopP(p)(np.log(f64(TOP_P_PROBS)), np.array([]))
    assert kept(out) == expected
    np.testing.assert_allclose(out[sorted(expected)], np.log(f64(TOP_P_PROBS))[sorted(expected)])


@pytest.mark.parametrize("p, expected", [(0.25, {0}), (0.5, {0, 1}), (0.51, {0, 1, 2})])
def test_top_p_stops_once_the_mass_is_reached_ties_by_id(p, expected):
    # uniform over 4: the running mass hits 0.25 and 0.5 exactly (HF removes a token
    # when the mass of the tokens before it is >= p)
    assert kept(TopP(p)(np.zeros(4), np.array([]))) == expected


# probabilities 0.4, 0.3, 0.2, 0.1: entropy 1.2799 nats; |surprisal - entropy| =
# 0.364, 0.076, 0.330, 1.023, so the typical order is ids 1, 2, 0, 3 (id 0, the likeliest, is third)
TYPICAL_PROBS = [0.4, 0.3, 0.2, 0.1]


@pytest.mark.parametrize("mass, expected", [
    (0.1, {1}), (0.25, {1}), (0.4, {1, 2}), (0.6, {0, 1, 2}), (0.95, {0, 1, 2, 3}),
])
def test_typical_p_by_hand(mass, expected):
    assert kept(TypicalP(mass)(np.log(f64(TYPICAL_PROBS)), np.array([]))) == expected


def test_typical_p_keeps_ties_uniform_is_untouched():
    assert kept(TypicalP(0.2)(np.zeros(8), np.array([]))) == set(range(8))


@pytest.mark.parametrize("vocab, scale", [(50, 1.0), (5000, 0.3), (5000, 3.0), (5000, 12.0)])
@pytest.mark.parametrize("mass", [0.05, 0.3, 0.7, 0.9, 0.99])
def test_top_p_and_typical_match_full_sort_reference(vocab, scale, mass):
    rng = np.random.default_rng(vocab + int(scale * 10))
    for _ in range(3):
        logits = rng.standard_normal(vocab) * scale
        assert kept(TopP(mass)(logits.copy(), np.array([]))) == ref_top_p_keep(logits, mass)
        assert kept(TypicalP(mass)(logits.copy(), np.array([]))) == ref_typical_keep(logits, mass)


def test_top_p_and_typical_ignore_filtered_tokens():
    logits = f64([NEG, 0.0, NEG, 1.0, 2.0, NEG])
    live = f64([0.0, 1.0, 2.0])
    assert kept(TopP(0.6)(logits.copy(), np.array([]))) == {[1, 3, 4][i] for i in ref_top_p_keep(live, 0.6)}
    typical = ref_typical_keep(live, 0.5)
    assert kept(TypicalP(0.5)(logits.copy(), np.array([]))) == {[1, 3, 4][i] for i in typical}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({}, []),
        (dict(do_sample=False, temperature=0.5, top_k=5, top_p=0.5, typical_p=0.5), []),
        (dict(do_sample=False, repetition_penalty=1.2, watermark=True), [Watermark, RepetitionPenalty]),
        (dict(temperature=0.7, top_k=5, top_p=0.9, typical_p=0.8, repetition_penalty=1.1, watermark=True),
         [Watermark, RepetitionPenalty, Temperature, TopK, TopP, TypicalP]),
        (dict(top_k=3), [TopK]),
        (dict(top_p=0.9), [TopP]),
    ],
)
def test_chain_has_one_processor_per_non_neutral_value(overrides, expected):
    assert [type(p) for p in build_processors(params(**overrides))] == expected


# --- the chooser ---

def test_greedy_is_argmax_with_log_softmax_logprob_and_ignores_warpers():
    logits = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    want = 3.0 - math.log(math.exp(1) + math.exp(3) + math.exp(2))
    for p in (params(do_sample=False), params(do_sample=False, temperature=0.1, top_k=1, top_p=0.1)):
        token, logprob = NextTokenChooser(p).choose(logits, [0])
        assert token == 1
        assert logprob == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("vocab_size", [None, 1000])
def test_plain_greedy_gives_the_general_paths_bits(vocab_size):
    """A greedy chooser with nothing to apply skips the float64 copy; a mask allowing every token takes the
    general path: the same id and the same logprob bits, on rows with ties, -inf, huge and tiny values."""
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(1024).astype(np.float32) * s for s in (0.01, 1.0, 30.0, 3e4)]
    tied = rng.integers(-3, 3, 1024).astype(np.float32)  # the max repeated: the first index wins
    holes = rows[1].copy()
    holes[::3] = -np.inf
    chooser = NextTokenChooser(params(do_sample=False), vocab_size=vocab_size)
    everything = np.ones(1024, dtype=bool)
    for row in [*rows, tied, holes]:
        fast = chooser.choose_with_top(row, [0])
        general = chooser.choose_with_top(row, [0], allowed=everything)
        assert fast[0] == general[0]
        assert np.float64(fast[1]).tobytes() == np.float64(general[1]).tobytes()
    assert chooser.choose(tied, [0])[0] == int(np.argmax(tied[:vocab_size]))


@pytest.mark.parametrize(
    "penalty, logits, history, token, final",
    [
        (2.0, [3.0, 2.0, -1.0], [0], 1, [1.5, 2.0, -1.0]),  # penalised favourite loses
        (0.5, [1.0, 1.5], [0], 0, [2.0, 1.5]),  # < 1 rewards a seen positive logit
        (2.0, [-1.0, -1.5], [0], 1, [-2.0, -1.5]),  # a seen negative logit gets more negative
    ],
)
def test_greedy_applies_repetition_penalty(penalty, logits, history, token, final):
    chooser = NextTokenChooser(params(do_sample=False, repetition_penalty=penalty))
    got, logprob = chooser.choose(np.array(logits, dtype=np.float32), history)
    assert got == token
    assert logprob == pytest.approx(final[token] - math.log(sum(math.exp(x) for x in final)))


def test_sampled_logprob_is_under_the_final_distribution():
    logits = np.log(f64([0.1, 0.2, 0.3, 0.4]))
    chooser = NextTokenChooser(params(top_k=2, seed=7))
    for _ in range(20):
        token, logprob = chooser.choose(logits, [])
        assert token in (2, 3)
        assert logprob == pytest.approx(math.log([0.1, 0.2, 0.3, 0.4][token] / 0.7))
    token, logprob = NextTokenChooser(params(temperature=0.5)).choose(f64([0.0, 1.0]), [])
    assert logprob == pytest.approx(math.log(softmax(f64([0.0, 2.0]))[token]))


def test_sampling_frequencies_follow_the_distribution():
    probs = [0.5, 0.3, 0.2]
    chooser = NextTokenChooser(params(seed=2024))
    counts = np.bincount([chooser.choose(np.log(f64(probs)), [])[0] for _ in range(20000)], minlength=3)
    np.testing.assert_allclose(counts / 20000, probs, atol=0.015)


@pytest.mark.parametrize("overrides", [
    {},
    dict(temperature=0.7, top_k=50),
    dict(top_p=0.9, typical_p=0.95),
    dict(repetition_penalty=1.3, watermark=True),
])
def test_same_seed_same_tokens_other_seed_other_tokens(overrides):
    run = [generate(NextTokenChooser(params(seed=s, **overrides)), 30) for s in (11, 11, 12, 2**64 - 1)]
    assert run[0] == run[1]
    assert run[0] != run[2]
    assert run[0] != run[3]


def test_top_k_1_and_tiny_top_p_equal_greedy():
    rng = np.random.default_rng(3)
    greedy = NextTokenChooser(params(do_sample=False))
    top_k = NextTokenChooser(params(top_k=1, seed=5))
    top_p = NextTokenChooser(params(top_p=1e-5, seed=6))
    for _ in range(50):
        logits = (rng.standard_normal(1000) * 2).astype(np.float32)
        want = greedy.choose(logits, [])
        assert top_k.choose(logits, []) == (want[0], 0.0)
        assert top_p.choose(logits, []) == (want[0], 0.0)
        assert want[0] == int(np.argmax(logits))


def test_padded_vocab_rows_are_never_chosen():
    logits = np.array([0.0, 0.1, 0.2, 50.0], dtype=np.float32)
    assert NextTokenChooser(params(do_sample=False), vocab_size=3).choose(logits, [3])[0] == 2
    chooser = NextTokenChooser(params(), vocab_size=3)
    assert {chooser.choose(logits, [])[0] for _ in range(50)} == {0, 1, 2}


@pytest.mark.parametrize("vocab_size", [3, None])
def test_prompt_logprobs_normalise_over_the_choosers_vocabulary(vocab_size):
    """Prompt logprobs and a greedy token's logprob are one log-softmax over one width: a padded row
    (here id 3, logit 50) carries no mass in either when the vocabulary stops before it."""
    logits = np.array([[0.0, 0.1, 2.2, 50.0], [1.0, 3.0, 2.0, 0.5]], dtype=np.float32)
    rows = vocab_log_softmax(logits, vocab_size)
    assert rows.shape == (2, vocab_size or 4) and rows.dtype == np.float64
    for logit_row, row in zip(logits, rows):
        token, logprob = NextTokenChooser(params(do_sample=False), vocab_size=vocab_size).choose(logit_row, [])
        assert row[token] == pytest.approx(logprob, abs=1e-12)
        assert np.exp(row).sum() == pytest.approx(1.0, abs=1e-12)


def test_batch_rows_are_independent():
    vocab, steps = 500, 12
    configs = [params(seed=1), params(seed=2, top_k=20, temperature=0.6), params(do_sample=False),
               params(seed=3, top_p=0.8, repetition_penalty=1.2, watermark=True)]
    rng = np.random.default_rng(0)
    logits = [(rng.standard_normal((len(configs), vocab)) * 2).astype(np.float32) for _ in range(steps)]
    histories = [[7 + b] for b in range(len(configs))]

    batch = [NextTokenChooser(c) for c in configs]
    together = [choose_batch(step, batch, histories) for step in logits]
    for b, config in enumerate(configs):
        alone = NextTokenChooser(config)
        for step, (ids, logprobs) in zip(logits, together):
            assert alone.choose(step[b], histories[b]) == (ids[b], logprobs[b])
    # a row's result does not depend on its neighbours either
    shuffled = [NextTokenChooser(configs[i]) for i in (3, 1)]
    for step, (ids, _) in zip(logits, together):
        got, _ = choose_batch(step[[3, 1]], shuffled, [histories[3], histories[1]])
        assert got.tolist() == [ids[3], ids[1]]


def test_batch_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        choose_batch(np.zeros((2, 4), dtype=np.float32), [NextTokenChooser(params())], [[1], [2]])


@pytest.mark.parametrize("probs, u, expected", [
    ([0.5, 0.5, 0.0], 0.0, 0),
    ([0.5, 0.5, 0.0], 0.4999, 0),
    ([0.5, 0.5, 0.0], 0.5, 1),
    ([0.5, 0.5, 0.0], 1.0, 1),  # a draw at the very top lands on the last live token
    ([0.0, 0.0, 1.0], 0.3, 2),
    ([1.0] + [0.0] * 2100, 1.0, 0),  # whole blocks of zeros at the end
    ([0.0] * 1500 + [1.0], 0.0, 1500),
])
def test_inverse_cdf_edges(probs, u, expected):
    assert _inverse_cdf(f64(probs), u) == expected


def test_inverse_cdf_matches_plain_cumsum_across_blocks():
    rng = np.random.default_rng(9)
    probs = rng.random(5000) ** 8
    cdf = np.cumsum(probs)
    for u in rng.random(300):
        assert _inverse_cdf(probs, u) == int(np.searchsorted(cdf, u * cdf[-1], side="right"))


# --- watermark ---

def test_green_list_is_a_deterministic_half_of_the_vocab():
    first = green_list(17, 1000)
    assert first.size == 500 and np.unique(first).size == 500 and first.max() < 1000
    np.testing.assert_array_equal(first, green_list(17, 1000))
    assert set(first.tolist()) != set(green_list(18, 1000).tolist())


def test_watermark_adds_delta_to_the_green_list_of_the_previous_token():
    out = Watermark()(np.zeros(10), np.array([3, 5]))
    expected = np.zeros(10)
    expected[green_list(5, 10)] = 2.0
    np.testing.assert_array_equal(out, expected)
    assert np.count_nonzero(out) == 5


def test_z_score_formula():
    ids = [4]
    for _ in range(16):  # an all-green continuation: z = (16 - 8) / sqrt(16 / 4) = 4
        ids.append(int(green_list(ids[-1], 100)[0]))
    assert watermark_z_score(ids, 100) == pytest.approx(4.0)
    red = [4]
    for _ in range(16):
        red.append(int(np.setdiff1d(np.arange(100), green_list(red[-1], 100))[0]))
    assert watermark_z_score(red, 100) == pytest.approx(-4.0)
    assert watermark_z_score([4], 100) == 0.0


def test_watermarked_generation_is_detected():
    marked = generate(NextTokenChooser(params(watermark=True, seed=8)), 200)
    plain = generate(NextTokenChooser(params(seed=8)), 200)
    assert watermark_z_score([1] + marked, 1000) > 4.0
    assert abs(watermark_z_score([1] + plain, 1000)) < 3.0
