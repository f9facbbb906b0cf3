"""vocab.cc: the one-pass scan of logits rows (argmax, log-sum-exp, best k) against NumPy on every variant this
host builds (the scalar one included), ties and -inf included, the same bits on every variant and thread count;
and the embedding gathered from a packed Q8_0 head against the dequantized table."""
from __future__ import annotations

import numpy as np
import pytest

from backends.mindspore.kernels.vocab import MAX_BEST, scan_rows
from backends.mindspore.kernels import build as kbuild
from tests.support.kernel_variants import HOST_VARIANTS, NATIVE, variant_lib

RUNNABLE = [v for v in HOST_VARIANTS if kbuild.runs_here(kbuild.variant_named(v))]


def _reference(row: np.ndarray, k: int):
    wide = row.astype(np.float64)
    top = wide.max()
    lse = top if not np.isfinite(top) else top + np.log(np.exp(wide - top).sum())
    order = np.lexsort((np.arange(row.size), -wide))[:k]  # value descending, then id ascending
    return int(np.argmax(row)), lse, order


def _rows(rng) -> list[np.ndarray]:
    v = 262_144 + 37  # Gemma 3's vocabulary and a ragged last chunk
    plain = (rng.standard_normal(v) * 3).astype(np.float32)
    ties = np.round(rng.standard_normal(v)).astype(np.float32)  # few distinct values: ties everywhere
    ties[[5, 70_000, 262_000]] = 9.0  # the max three times: the first wins
    masked = plain.copy()
    masked[rng.random(v) < 0.999] = -np.inf  # a grammar-like mask: few finite values
    few = np.full(v, -np.inf, np.float32)
    few[[3, 200_000]] = [1.0, 1.0]  # fewer finite values than k
    small = (rng.standard_normal(7) * 2).astype(np.float32)  # shorter than k
    return [plain, ties, masked, few, small, np.full(100, -np.inf, np.float32)]


@pytest.mark.parametrize("variant", HOST_VARIANTS)
@pytest.mark.parametrize("k", [0, 1, 20, 51])
def test_scan_matches_numpy(kernel_cache, variant, k):
    lib = variant_lib(kernel_cache, variant)
    for row in _rows(np.random.default_rng(k)):
        argmax, lse, ids, vals = scan_rows(row.reshape(1, -1), k, lib)
        want_arg, want_lse, want_ids = _reference(row, k)
        assert argmax[0] == want_arg
        if np.isfinite(want_lse):
            assert lse[0] == pytest.approx(want_lse, rel=0, abs=2e-5 * max(1.0, abs(want_lse)))
        else:
            assert lse[0] == want_lse
        got = ids[0][ids[0] >= 0]
        assert got.tolist() == want_ids.tolist()
        assert vals[0][: got.size].tolist() == row[got].tolist()
        assert (ids[0][got.size:] == -1).all() and (vals[0][got.size:] == -np.inf).all()


def test_scan_is_the_same_on_every_variant_thread_count_and_batch(kernel_cache):
    rng = np.random.default_rng(3)
    batch = np.stack([r for r in _rows(rng) if r.size == 262_144 + 37])
    padded = np.zeros((batch.shape[0], batch.shape[1] + 11), np.float32)
    padded[:, : batch.shape[1]] = batch
    results = []
    for variant in RUNNABLE:
        lib = variant_lib(kernel_cache, variant)
        for threads in (1, 3):
            lib.mindserve_matmul_set_threads(threads)
            results.append(scan_rows(padded[:, : batch.shape[1]], 20, lib))  # strided rows
            results.append(tuple(np.concatenate(parts) for parts in
                                 zip(*(scan_rows(row.reshape(1, -1), 20, lib) for row in batch))))
        lib.mindserve_matmul_set_threads(2)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert a.tobytes() == b.tobytes()


def test_scan_refuses_what_it_does_not_take(kernel_cache):
    lib = variant_lib(kernel_cache, NATIVE)
    with pytest.raises(ValueError):
        scan_rows(np.zeros((1, 8), np.float64), 1, lib)
    with pytest.raises(ValueError):
        scan_rows(np.zeros((1, 8), np.float32), MAX_BEST + 1, lib)
    with pytest.raises(ValueError):
        scan_rows(np.zeros((2, 16), np.float32)[:, ::2], 1, lib)


def _aot_call(lib, entry: str, arrays: list[np.ndarray]) -> int:
    """``entry`` called as MindSpore calls an AOT entry."""
    import ctypes

    n = len(arrays)
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    return getattr(lib, entry)(n, (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]),
                               (ctypes.c_int * n)(*[a.ndim for a in arrays]),
                               (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                                      for s in shapes]),
                               (ctypes.c_char_p * n)(*[a.dtype.name.encode() for a in arrays]), None, None)


@pytest.mark.parametrize("variant", RUNNABLE)
def test_embedding_rows_from_the_packed_head_are_the_tables(kernel_cache, variant):
    from backends.mindspore.kernels import dequantize_qweight, prepare_qweight
    from backends.mindspore.modeldir.quant import quantize

    lib = variant_lib(kernel_cache, variant)
    rng = np.random.default_rng(5)
    vocab, dim, hd, positions = 16 * 5 + 7, 96, 8, 11  # a narrower last group of 16 columns
    q = quantize((rng.standard_normal((vocab, dim)) * 0.3).astype(np.float32), "q8_0")
    head = prepare_qweight(q, kernel_cache, variant)
    table = dequantize_qweight(q, kernel_cache, variant)
    cos_t, sin_t = (rng.standard_normal((positions, hd)).astype(np.float32) for _ in range(2))
    ids = np.array([[0, vocab - 1, 15, 16, 81, 3]], np.int32)
    pos = np.array([[0, 10, 3, 3, 5, 9]], np.int32)
    out = [np.full((6, dim), np.nan, np.float32), np.full((6, hd), np.nan, np.float32),
           np.full((6, hd), np.nan, np.float32)]
    assert _aot_call(lib, "MindserveEmbedRopePacked", [ids, pos, head, cos_t, sin_t, *out]) == 0
    assert out[0].tobytes() == table[ids[0]].tobytes()
    assert out[1].tobytes() == cos_t[pos[0]].tobytes() and out[2].tobytes() == sin_t[pos[0]].tobytes()
    bad = np.array([[0, vocab, 1, 1, 1, 1]], np.int32)
    assert _aot_call(lib, "MindserveEmbedRopePacked", [bad, pos, head, cos_t, sin_t, *out]) != 0


def test_a_chooser_on_the_native_scan_chooses_as_numpy(kernel_cache):
    from backends.mindspore.kernels.vocab import native_scanner
    from backends.sampling import NextTokenChooser
    from backends.types import SamplingParams

    scan = native_scanner(variant_lib(kernel_cache, NATIVE))
    rng = np.random.default_rng(8)
    rows = [(rng.standard_normal(262_144) * 3).astype(np.float32) for _ in range(6)]
    for sample in (dict(do_sample=False), dict(do_sample=True, top_k=40, temperature=0.8, seed=3),
                   dict(do_sample=True, top_p=0.6, seed=3), dict(do_sample=False, repetition_penalty=1.3)):
        p = SamplingParams(**{**dict(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, typical_p=1.0,
                                     repetition_penalty=1.0, watermark=False, seed=42), **sample})
        plain, native = NextTokenChooser(p, 262_000), NextTokenChooser(p, 262_000, scan=scan)
        for row in rows:
            history = np.argsort(-row)[:3]  # the penalty moves the best tokens
            want, got = plain.choose_with_top(row, history, top=4), native.choose_with_top(row, history, top=4)
            assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-5)
            assert [i for i, _ in got[2]] == [i for i, _ in want[2]]
