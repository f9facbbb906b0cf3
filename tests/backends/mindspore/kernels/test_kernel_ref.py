"""The reference's own primitives against exact rational arithmetic: fma32 (one rounding, incl. the double-rounding
midpoints, subnormals, cancellation, signed zeros, overflow), the scalef step of exp (np.ldexp rounds once), the
exp polynomial's accuracy, and the reduction tree's lane order."""
from __future__ import annotations

from fractions import Fraction

import numpy as np

from tests.support import kernel_ref as ref

F32 = np.float32
FLT_MAX = Fraction(float(np.finfo(F32).max))


def _round_f32(q: Fraction, zero_sign: float) -> np.float32:
    """Exact q rounded to nearest float32, ties to even (q == 0: +-0 by zero_sign)."""
    if q == 0:
        return F32(np.copysign(0.0, zero_sign))
    top = FLT_MAX + Fraction(2) ** 103  # FLT_MAX + half an ulp: from here on (inclusive) the result is inf
    if abs(q) >= top:
        return F32(np.inf if q > 0 else -np.inf)
    guess = F32(float(q))
    if np.isinf(guess):
        guess = F32(np.copysign(np.finfo(F32).max, float(q)))
    cands = {guess, np.nextafter(guess, F32(np.inf)), np.nextafter(guess, F32(-np.inf))}
    cands = [c for c in cands if np.isfinite(c)]

    def key(c):
        return abs(Fraction(float(c)) - q), int(np.array(c).view(np.uint32)) & 1

    best = min(cands, key=key)
    return F32(np.copysign(0.0, float(q))) if best == 0 else best


def _exact_fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    p = Fraction(float(a)) * Fraction(float(b))
    q = p + Fraction(float(c))
    prod_neg = np.signbit(a) != np.signbit(b)
    zero_sign = -1.0 if (q == 0 and p == 0 and prod_neg and np.signbit(c)) else 1.0
    return _round_f32(q, zero_sign)


def _bits(x):
    return np.asarray(x, F32).view(np.uint32)


def _samples(rng: np.random.Generator, n: int):
    """(a, b, c) float32 triples: random, midpoint products, cancellation, subnormals, zeros, overflow."""
    def f(lo, hi, size):  # random mantissa and sign, exponent in [lo, hi)
        return (rng.uniform(1, 2, size) * np.exp2(rng.integers(lo, hi, size)) * rng.choice([-1, 1], size)).astype(F32)
    out = []
    out.append((f(-20, 20, n), f(-20, 20, n), f(-40, 40, n)))  # random
    odd = (rng.integers(2 ** 23, 2 ** 24, n) | 1).astype(np.float64)  # odd 24-bit mantissas
    x = (odd * np.exp2(rng.integers(-30, 10, n) - 23.0) * rng.choice([-1, 1], n)).astype(F32)
    b = rng.choice(np.array([1.5, 0.75, 3.0, -1.5], F32), n)
    tiny = (f(-80, -60, n) * np.abs(x)).astype(F32)  # far below half an ulp of the midpoint product x * b
    out.append((x, b, tiny))  # x * b is a float32 midpoint: the double-rounding case
    out.append((x, b, np.zeros(n, F32)))  # exact ties: ties to even
    out.append((x, b, (tiny * F32(-1)).astype(F32)))
    a, bb = f(-10, 10, n), f(-10, 10, n)
    out.append((a, bb, (-(a * bb)).astype(F32)))  # cancellation: the rounding error of a * b
    out.append((a, bb, (-(a * bb) * F32(1 + 2 ** -20)).astype(F32)))
    out.append((f(-80, -60, n), f(-80, -60, n), f(-150, -126, n)))  # subnormal results and addends
    out.append((f(-75, -70, n), f(-60, -55, n), (rng.integers(-2 ** 10, 2 ** 10, n) * 2.0 ** -149).astype(F32)))
    zeros = np.array([0.0, -0.0], F32)
    out.append((rng.choice(zeros, n), f(-5, 5, n), rng.choice(zeros, n)))  # signed zeros
    out.append((f(-5, 5, n), rng.choice(zeros, n), rng.choice(zeros, n)))
    out.append((f(-80, -70, n), f(-80, -70, n), rng.choice(zeros, n)))  # underflow to a signed zero
    out.append((f(60, 64, n), f(60, 64, n), f(120, 128, n)))  # near and past FLT_MAX
    return [tuple(np.asarray(v, F32) for v in t) for t in out]


def test_fma32_is_the_correctly_rounded_fma():
    rng = np.random.default_rng(0)
    checked = 0
    for a, b, c in _samples(rng, 500):
        got = ref.fma32(a, b, c)
        want = np.array([_exact_fma(*t) for t in zip(a, b, c)], F32)
        bad = np.flatnonzero(_bits(got) != _bits(want))
        assert bad.size == 0, [(a[i], b[i], c[i], got[i], want[i]) for i in bad[:5]]
        checked += a.size
    assert checked == 6000


def test_fma32_midpoint_cases_really_need_the_correction():
    """The midpoint family is the case a float64 fma then a float32 cast gets wrong: the samples must contain it."""
    rng = np.random.default_rng(1)
    a, b, c = _samples(rng, 500)[1]
    naive = (a.astype(np.float64) * b + c).astype(F32)
    assert np.count_nonzero(_bits(naive) != _bits(ref.fma32(a, b, c))) > 50


def test_ldexp_rounds_once_into_the_subnormals():
    rng = np.random.default_rng(2)
    p = rng.uniform(0.5, 2.0, 4000).astype(F32)
    n = rng.integers(-160, 1, 4000).astype(np.int32)
    got = np.ldexp(p, n).astype(F32)
    want = np.array([_round_f32(Fraction(float(v)) * Fraction(2) ** int(e), 1.0) for v, e in zip(p, n)], F32)
    assert np.array_equal(_bits(got), _bits(want))


def test_exp_nonpositive_is_accurate_and_zero_below_range():
    x = np.concatenate([-np.geomspace(1e-30, 87, 3000), [0.0, -0.0]]).astype(F32)
    e = ref.exp_nonpositive(x)
    assert np.max(np.abs(e.astype(np.float64) / np.exp(x.astype(np.float64)) - 1)) < 4e-7
    assert ref.exp_nonpositive(np.array([-104, -1e30, -np.inf], F32)).tolist() == [ref.exp_nonpositive(F32(-103))] * 3


def test_reduce_add16_is_the_halving_tree():
    """Lane for lane the tree of GCC 12's __MM512_REDUCE_OP: hi half + lo half, twice, then {2, 3, 0, 1}, then 0 + 1."""
    rng = np.random.default_rng(3)
    v = (rng.standard_normal((200, 16)) * np.exp2(rng.integers(-30, 30, (200, 16)))).astype(F32)
    for row, got in zip(v, ref.reduce_add16(v)):
        t3 = [row[i + 8] + row[i] for i in range(8)]
        t6 = [t3[i + 4] + t3[i] for i in range(4)]
        assert _bits((t6[0] + t6[2]) + (t6[1] + t6[3])) == _bits(got)
    sequential = np.add.accumulate(v, axis=1, dtype=F32)[:, -1]
    assert np.any(_bits(sequential) != _bits(ref.reduce_add16(v)))  # the order is part of the result
