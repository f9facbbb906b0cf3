"""Pearson's chi-square test of homogeneity for two histograms, and its p-value, written for the tests (the
project has no SciPy): ``chi2_sf`` is the regularised upper incomplete gamma Q(df/2, x/2), by its series below
a + 1 and its continued fraction above (Numerical Recipes 6.2), checked against table values in
tests/test_chi_square.py."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

MIN_EXPECTED = 5.0  # a bin whose expected count in either sample is below this is merged into "other"


@dataclass(frozen=True, slots=True)
class ChiSquare:
    statistic: float
    df: int
    p_value: float
    bins: int


def homogeneity(a: Counter, b: Counter) -> ChiSquare:
    """Do the samples ``a`` and ``b`` (category -> count) come from one distribution? Categories with fewer
    than MIN_EXPECTED expected in either sample pool into one "other" bin (itself dropped if still small)."""
    na, nb = sum(a.values()), sum(b.values())
    n = na + nb
    kept, other = [], [0, 0]
    for key in sorted(set(a) | set(b)):
        row = [a.get(key, 0), b.get(key, 0)]
        if min(na, nb) * sum(row) / n >= MIN_EXPECTED:
            kept.append(row)
        else:
            other = [other[0] + row[0], other[1] + row[1]]
    if min(na, nb) * sum(other) / n >= MIN_EXPECTED:
        kept.append(other)
    stat = 0.0
    for row in kept:
        total = sum(row)
        for count, size in zip(row, (na, nb)):
            expected = size * total / n
            stat += (count - expected) ** 2 / expected
    df = len(kept) - 1
    return ChiSquare(stat, df, chi2_sf(stat, df), len(kept))


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with ``df`` degrees of freedom."""
    if x <= 0:
        return 1.0
    return _gamma_q(df / 2.0, x / 2.0)


def _gamma_q(a: float, x: float) -> float:
    if x < a + 1.0:  # the series of P converges fast here
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return 1.0 - total * math.exp(-x + a * math.log(x) - math.lgamma(a))
    tiny = 1e-300  # Lentz's continued fraction for Q
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h
