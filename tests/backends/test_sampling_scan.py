"""A chooser given a one-pass row scan (``RowScanner``: the engine's is kernels/vocab.py's) chooses what it
chooses without one: greedy ids and top lists, and a top-k chain's draws from the same seed, from the row's best
k + 1 alone; a tie at the k-th value, a mask or a penalty takes the whole row. The scanner here is NumPy's, the
reference the kernel's own tests hold it to (tests/backends/mindspore/kernels/test_vocab_kernel.py)."""
from __future__ import annotations

import numpy as np
import pytest

from backends.logit_processors import LogitBias, SuppressEos
from backends.sampling import NextTokenChooser, RowScan
from backends.types import SamplingParams


def params(**overrides) -> SamplingParams:
    base = dict(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, typical_p=1.0,
                repetition_penalty=1.0, watermark=False, seed=42)
    return SamplingParams(**{**base, **overrides})


class CountingScan:
    """NumPy's scan of a row, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.wide: list[bool] = []

    def __call__(self, row: np.ndarray, k: int) -> RowScan:
        self.calls += 1
        self.wide.append(k > 64)
        wide = row.astype(np.float64)
        top = wide.max()
        lse = top + np.log(np.exp(wide - top).sum()) if np.isfinite(top) else top
        best = np.lexsort((np.arange(row.size), -wide))[:k]
        return RowScan(int(np.argmax(row)), float(lse), best.astype(np.int64), wide[best])


def _rows(rng, n=40, vocab=3000):
    rows = [(rng.standard_normal(vocab) * 2).astype(np.float32) for _ in range(n)]
    tied = np.round(rng.standard_normal(vocab)).astype(np.float32)  # ties at every k-th value
    return [*rows, tied]


@pytest.mark.parametrize("top", [0, 1, 5])
def test_greedy_scanned_is_greedy(top):
    scan = CountingScan()
    plain = NextTokenChooser(params(do_sample=False), vocab_size=2990)
    scanned = NextTokenChooser(params(do_sample=False), vocab_size=2990, scan=scan)
    for row in _rows(np.random.default_rng(top)):
        want, got = plain.choose_with_top(row, [0], top=top), scanned.choose_with_top(row, [0], top=top)
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-9)
        np.testing.assert_allclose([lp for _, lp in got[2]], [lp for _, lp in want[2]], atol=1e-9)
        # the top list's ids, ties by id (the whole row's path may pick any of the tokens tied at the last place)
        assert [i for i, _ in got[2]] == np.lexsort((np.arange(2990), -row[:2990]))[:top].tolist()
    assert scan.calls == 41


@pytest.mark.parametrize("overrides", [dict(top_k=40), dict(top_k=7, temperature=0.6, top_p=0.8),
                                       dict(top_k=50, typical_p=0.9), dict(top_k=1)])
def test_top_k_chain_scanned_draws_the_same_tokens(overrides):
    scan = CountingScan()
    plain = NextTokenChooser(params(seed=9, **overrides))
    scanned = NextTokenChooser(params(seed=9, **overrides), scan=scan)
    rows = _rows(np.random.default_rng(1))
    for row in rows:
        want, got = plain.choose_with_top(row, [0], top=3), scanned.choose_with_top(row, [0], top=3)
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-9)
        assert [i for i, _ in got[2]] == [i for i, _ in want[2]]
    assert scan.calls == len(rows)


def test_a_tie_at_the_kth_value_a_mask_or_a_penalty_takes_the_whole_row():
    row = np.array([3.0, 1.0, 2.0, 2.0, 2.0, 0.5], np.float32)  # top-2: the 2nd value is tied three times
    scan = CountingScan()
    plain = NextTokenChooser(params(top_k=2, seed=4))
    scanned = NextTokenChooser(params(top_k=2, seed=4), scan=scan)
    assert [scanned.choose(row, [0]) for _ in range(30)] == [plain.choose(row, [0]) for _ in range(30)]
    assert scan.calls == 30  # scanned, then the whole row each time
    penalised = NextTokenChooser(params(top_k=2, repetition_penalty=1.5), scan=scan)
    assert penalised.best_k == 0
    greedy = NextTokenChooser(params(do_sample=False), scan=scan)
    assert greedy.choose(row, [0], allowed=np.array([0, 1, 1, 1, 1, 1], bool))[0] == 2
    assert scan.calls == 30


@pytest.mark.parametrize("p", [0.3, 0.9, 0.99])
def test_nucleus_alone_scanned_draws_the_same_tokens(p):
    scan = CountingScan()
    plain = NextTokenChooser(params(seed=5, top_p=p))
    scanned = NextTokenChooser(params(seed=5, top_p=p), scan=scan)
    assert scanned.nucleus
    rows = [row * 3 for row in _rows(np.random.default_rng(2))]  # peaked enough that a best list holds the nucleus
    for row in rows:
        want, got = plain.choose_with_top(row, [0], top=4), scanned.choose_with_top(row, [0], top=4)
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-9)
        if row is not rows[-1]:  # (on the tied row the whole row's top list may hold any of the tied tokens)
            assert [i for i, _ in got[2]] == [i for i, _ in want[2]]
        np.testing.assert_allclose([lp for _, lp in got[2]], [lp for _, lp in want[2]], atol=1e-9)
    assert scan.calls == len(rows) + sum(scan.wide)  # one scan a row (a flat one: the best 64, then 256)


def test_a_flat_row_takes_the_whole_row_for_the_nucleus():
    row = np.zeros(3000, np.float32)  # 256 of 3000 equal tokens hold 8.5% of the mass
    scan = CountingScan()
    plain = NextTokenChooser(params(seed=3, top_p=0.5))
    scanned = NextTokenChooser(params(seed=3, top_p=0.5), scan=scan)
    assert [scanned.choose(row, [0]) for _ in range(5)] == [plain.choose(row, [0]) for _ in range(5)]
    assert scan.calls == 5  # the best 64, whose last bounds the next 192 below p: then the whole row
    assert not NextTokenChooser(params(top_p=0.5, temperature=0.7), scan=scan).nucleus


SPARSE_CASES = {
    "penalty": (dict(repetition_penalty=1.3), ()),
    "penalty below 1": (dict(repetition_penalty=0.7), ()),
    # seen tokens' logits divided by 1e-3: far past exp's range from the row's log-sum-exp (was an overflow, -inf)
    "tiny penalty": (dict(repetition_penalty=1e-3), ()),
    "logit bias": (dict(), (LogitBias(np.array([5, 17, 5]), np.array([3.0, -100.0, 1.5])),)),
    "EOS banned": (dict(), (SuppressEos(np.array([0, 2]), 10_000),)),
    "all three": (dict(repetition_penalty=1.2), (LogitBias(np.array([9]), np.array([100.0])),
                                                 SuppressEos(np.array([0]), 10_000))),
}


@pytest.mark.parametrize("name", SPARSE_CASES)
@pytest.mark.parametrize("top", [0, 3])
def test_greedy_with_a_few_tokens_edited_is_chosen_from_the_scan(name, top):
    overrides, first = SPARSE_CASES[name]
    scan = CountingScan()
    plain = NextTokenChooser(params(do_sample=False, **overrides), vocab_size=2990, first=first)
    scanned = NextTokenChooser(params(do_sample=False, **overrides), vocab_size=2990, first=first, scan=scan)
    assert scanned.sparse
    rng = np.random.default_rng(len(name) + top)
    rows = _rows(rng)
    for row in rows:
        history = rng.integers(0, 2990, 30)
        history[:3] = np.argsort(-row[:2990])[:3]  # the best tokens are in the history: the penalty moves them
        want, got = plain.choose_with_top(row, history, top=top), scanned.choose_with_top(row, history, top=top)
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-9)
        if row is not rows[-1]:  # (on the tied row the whole row's top list may hold any of the tied tokens)
            assert [i for i, _ in got[2]] == [i for i, _ in want[2]]
        np.testing.assert_allclose([lp for _, lp in got[2]], [lp for _, lp in want[2]], atol=1e-9)
        assert scanned._choose_scanned(row[:2990], history, top) is not None  # from the scan, not the whole row


def test_sparse_greedy_takes_the_whole_row_when_the_edited_tokens_held_most_mass():
    row = np.full(100, -5.0, np.float32)
    row[7] = 20.0  # nearly all the mass, banned: the rest's log-sum-exp would be a difference of near-equals
    ban = (SuppressEos(np.array([7]), 10_000),)
    scan = CountingScan()
    plain = NextTokenChooser(params(do_sample=False), first=ban)
    scanned = NextTokenChooser(params(do_sample=False), first=ban, scan=scan)
    assert scanned.choose(row, [1]) == plain.choose(row, [1])
    only_eos = np.full(100, -np.inf, np.float32)
    only_eos[7] = 1.0  # EOS is the only choice: the ban steps back
    assert scanned.choose(only_eos, [1]) == plain.choose(only_eos, [1]) == (7, 0.0)
    assert scan.calls == 2  # scanned, then the whole row each time
