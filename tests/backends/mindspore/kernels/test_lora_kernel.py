"""The LoRA tail of the AOT matmul (kernels/lora.h): each row adds its own adapter's low-rank delta,
checked against NumPy; base rows stay bit-identical to the plain product; rows are batch-independent."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from backends.mindspore.kernels import prepare_weight

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _factors(rng, slots: int, k: int, segs: list[int], rank: int):
    """a [S, K, G*R], b [S, R, N]: random, as the engine packs them (scale folded into b)."""
    g, n = len(segs) - 1, segs[-1]
    a = rng.standard_normal((slots, k, g * rank)).astype(np.float32) / np.sqrt(k)
    b = rng.standard_normal((slots, rank, n)).astype(np.float32) / np.sqrt(rank)
    return a, b


def _run(lib, x, w, a, b, rows, segs, res=None):
    x = np.ascontiguousarray(x, np.float32)
    packed = prepare_weight(w)
    m, k = x.shape
    n = w.shape[1]
    rows = np.asarray(rows, np.int32)
    seg = np.asarray(segs, np.int32)
    y = np.full((m, n), np.nan, np.float32)
    res_ptr = None if res is None else np.ascontiguousarray(res, np.float32).ctypes.data
    lib.mindserve_matmul_lora_raw(x.ctypes.data, packed.ctypes.data, res_ptr, y.ctypes.data, m, k, n,
                                  a.ctypes.data, b.ctypes.data, rows.ctypes.data, seg.ctypes.data,
                                  a.shape[0], len(segs) - 1, b.shape[1])
    return y


def _reference(x, w, a, b, rows, segs, res=None):
    """float64 NumPy: y = res + x @ W + (x @ a[s])[g(n) block] @ b[s] per row."""
    x64, y = x.astype(np.float64), x.astype(np.float64) @ w.astype(np.float64)
    if res is not None:
        y += res
    rank = b.shape[1]
    for m, s in enumerate(rows):
        if s < 0:
            continue
        t = x64[m] @ a[s].astype(np.float64)
        for g in range(len(segs) - 1):
            lo, hi = segs[g], segs[g + 1]
            y[m, lo:hi] += t[g * rank:(g + 1) * rank] @ b[s][:, lo:hi].astype(np.float64)
    return y


CASES = [  # K, segment boundaries (a fused qkv of SmolLM2, gate_up, odd sizes), rank
    (576, [0, 576, 768, 960], 16),
    (576, [0, 1536, 3072], 8),
    (1536, [0, 576], 4),
    (37, [0, 5, 70, 71], 3),
    (64, [0, 100], 33),
]


@pytest.mark.parametrize("k,segs,rank", CASES)
@pytest.mark.parametrize("m", [1, 7, 20])
def test_lora_tail_matches_numpy(lib, k, segs, rank, m):
    rng = np.random.default_rng(k + m + rank)
    n = segs[-1]
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    a, b = _factors(rng, 3, k, segs, rank)
    rows = rng.integers(-1, 3, m)
    res = rng.standard_normal((m, n)).astype(np.float32)
    for r in (None, res):
        got = _run(lib, x, w, a, b, rows, segs, r)
        np.testing.assert_allclose(got, _reference(x, w, a, b, rows, segs, r), rtol=2e-5, atol=2e-5)


def test_base_rows_are_bit_identical_to_the_plain_product(lib):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    w = rng.standard_normal((576, 960)).astype(np.float32)
    a, b = _factors(rng, 2, 576, [0, 576, 768, 960], 8)
    plain = np.empty((9, 960), np.float32)
    packed = prepare_weight(w)  # held: a temporary's pointer would dangle
    lib.mindserve_matmul_raw(x.ctypes.data, packed.ctypes.data, plain.ctypes.data, 9, 576, 960)
    rows = [-1, 0, -1, 1, -1, -1, 0, 1, -1]
    got = _run(lib, x, w, a, b, rows, [0, 576, 768, 960])
    base = [i for i, s in enumerate(rows) if s < 0]
    assert np.array_equal(got[base], plain[base])
    assert not np.array_equal(got[[1, 3]], plain[[1, 3]])  # adapter rows did change


def test_rows_are_bit_identical_alone_and_mixed(lib):
    """A row gives the same bits alone, mixed with other adapters' and base rows, whatever the threads."""
    rng = np.random.default_rng(2)
    segs = [0, 1536, 3072]
    x = rng.standard_normal((16, 576)).astype(np.float32)
    w = rng.standard_normal((576, 3072)).astype(np.float32)
    a, b = _factors(rng, 4, 576, segs, 16)
    rows = np.array([i % 5 - 1 for i in range(16)])
    mixed = _run(lib, x, w, a, b, rows, segs)
    for threads in (1, 2, 3):
        lib.mindserve_matmul_set_threads(threads)
        for i in range(16):
            alone = _run(lib, x[i:i + 1], w, a, b, rows[i:i + 1], segs)
            assert np.array_equal(alone[0], mixed[i]), (i, threads)
    lib.mindserve_matmul_set_threads(2)


def test_zero_padded_rank_adds_exact_zeros(lib):
    """An adapter of rank 4 in slots of rank 8 (the rest zero) equals the rank-4 product exactly."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    a4, b4 = _factors(rng, 1, 64, [0, 48], 4)
    a8, b8 = np.zeros((1, 64, 8), np.float32), np.zeros((1, 8, 48), np.float32)
    a8[..., :4], b8[:, :4] = a4, b4
    rows = [0] * 5
    assert np.array_equal(_run(lib, x, w, a4, b4, rows, [0, 48]), _run(lib, x, w, a8, b8, rows, [0, 48]))
