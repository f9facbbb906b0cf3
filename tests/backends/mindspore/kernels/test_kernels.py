"""The AOT fast matmul kernel: packing, correctness vs numpy, row determinism, GRAPH_MODE use, build cache."""
from __future__ import annotations

import ctypes
import os
import re
import shutil

import numpy as np
import pytest

from backends.mindspore.kernels import kernel_constants, prepare_weight
from backends.mindspore.kernels import build as kbuild
from tests.support.kernel_entries import call_aot as _aot_call

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

MODEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
ODD_SHAPES = [(1, 1), (5, 3), (37, 53), (100, 17), (577, 1001), (63, 129), (1537, 575)]
# Row counts around the register-tile splits (blocks of <= 8 rows, cut evenly: 20 -> 6 + 7 + 7).
MS = [1, 2, 3, 4, 8, 9, 16, 17, 20, 32, 64, 100]


def _mm(lib, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [M, K] @ w [K, N] through the kernel (w packed here; tests that loop pass it packed)."""
    x = np.ascontiguousarray(x, np.float32)
    packed = w if w.ndim == 3 else prepare_weight(w)
    _, k, n = packed.shape
    y = np.full((x.shape[0], n), np.nan, np.float32)
    lib.mindserve_matmul_raw(x.ctypes.data, packed.ctypes.data, y.ctypes.data, x.shape[0], k, n)
    return y


def test_the_library_exports_its_constants(lib):
    from backends.mindspore.modeldir.quant import BLOCK_SIZE, FORMATS
    from backends.mindspore.planning.kernel_path import MAX_AOT_HEAD_DIM

    c = kernel_constants()
    assert c.max_head_dim == MAX_AOT_HEAD_DIM  # the fit rule reads kv_format.h before any build
    assert c.panel == lib.mindserve_matmul_panel_width()
    assert c.formats == tuple(FORMATS) and c.block == {f: BLOCK_SIZE[f] for f in FORMATS}
    assert c.kinds[0] == "matmul" and c.max_segments >= 2 and len(c.segment_magic) == 4


def test_every_operator_of_the_table_is_an_entry_of_the_library(lib):
    import dataclasses

    from backends.mindspore.kernels import OPS, AotOps
    from backends.mindspore.kernels.ops import manual

    assert [f.name for f in dataclasses.fields(AotOps)] == [op.name for op in OPS]
    assert [op.entry for op in OPS if not hasattr(lib, op.entry)] == []
    assert all(f"{op.name} ({op.entry})" in manual() for op in OPS)


@pytest.mark.parametrize("k,panels,extra", [(3, 1, 0), (4, 2, 5), (2, 0, 7)])
def test_prepare_weight_layout(lib, k, panels, extra):
    """Panels of the library's panel width, each [K, width] row-major, back to back; the last may be narrower."""
    PANEL = kernel_constants().panel  # noqa: N806
    n = panels * PANEL + extra
    w = np.arange(k * n, dtype=np.float32).reshape(k, n)
    packed = prepare_weight(w)
    assert packed.shape == (1, k, n) and packed.dtype == np.float32 and packed.flags.c_contiguous
    flat, offset = packed.ravel(), 0
    for n0 in range(0, n, PANEL):
        panel = w[:, n0:n0 + PANEL]
        np.testing.assert_array_equal(flat[offset:offset + panel.size], panel.ravel())
        offset += panel.size
    assert offset == k * n


def _rel_err(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    ref = x.astype(np.float64) @ w.astype(np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.mark.parametrize("k,n", MODEL_SHAPES + ODD_SHAPES)
def test_matches_numpy(lib, k, n):
    rng = np.random.default_rng(k * 7919 + n)
    w = rng.standard_normal((k, n), dtype=np.float32)
    packed = prepare_weight(w)
    for m in MS:
        x = rng.standard_normal((m, k), dtype=np.float32)
        y = _mm(lib, x, packed)
        assert np.isfinite(y).all(), (m, k, n)  # every element written (NaN-filled output)
        assert _rel_err(y, x, w) < 1e-5, (m, k, n)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k,n", [(576, 960), (576, 3072), (1536, 576), (577, 1001), (37, 53)])
def test_rows_are_bitwise_independent_of_batch(lib, k, n, threads):
    """Row i alone (M=1) equals row i inside any batch, whatever the other rows hold."""
    lib.mindserve_matmul_set_threads(threads)
    try:
        rng = np.random.default_rng(k + n)
        w = prepare_weight(rng.standard_normal((k, n), dtype=np.float32))
        x = rng.standard_normal((64, k), dtype=np.float32)
        singles = np.stack([_mm(lib, x[i:i + 1], w)[0] for i in range(64)])
        for m in MS:
            for trial in range(2):
                batch = rng.standard_normal((m, k), dtype=np.float32) * (10.0 ** trial)
                rows = rng.choice(64, size=min(m, 3), replace=False)
                pos = rng.choice(m, size=len(rows), replace=False)
                batch[pos] = x[rows]
                y = _mm(lib, batch, w)
                assert np.array_equal(y[pos], singles[rows]), (m, k, n, threads)
    finally:
        lib.mindserve_matmul_set_threads(2)


def test_tuning_knobs_do_not_change_bits(lib):
    rng = np.random.default_rng(1)
    w = prepare_weight(rng.standard_normal((576, 3072), dtype=np.float32))
    x = rng.standard_normal((16, 576), dtype=np.float32)
    base = _mm(lib, x, w)
    try:
        for knobs in [(0, 1), (512, 7), (48 * 576, 64), (64, 0)]:
            lib.mindserve_matmul_tune(*knobs)
            assert np.array_equal(_mm(lib, x, w), base), knobs
            assert np.array_equal(_mm(lib, x[5:6], w)[0], base[5]), knobs
    finally:
        lib.mindserve_matmul_tune(0, 0)


def test_aot_entry_rejects_bad_arguments(lib):
    """The MindSpore entry point validates dtypes and shapes (non-zero return = error)."""
    x = np.ones((2, 3), np.float32)
    w = prepare_weight(np.ones((3, 4), np.float32))
    y = np.zeros((2, 4), np.float32)
    params = (ctypes.c_void_p * 3)(x.ctypes.data, w.ctypes.data, y.ctypes.data)

    def call(shapes, dtypes):
        ndims = (ctypes.c_int * 3)(*[len(s) for s in shapes])
        arrs = [(ctypes.c_int64 * len(s))(*s) for s in shapes]
        sp = (ctypes.POINTER(ctypes.c_int64) * 3)(*[ctypes.cast(a, ctypes.POINTER(ctypes.c_int64)) for a in arrs])
        dt = (ctypes.c_char_p * 3)(*[d.encode() for d in dtypes])
        return lib.MindserveMatMul(3, params, ndims, sp, dt, None, None)

    assert call([(2, 3), (1, 3, 4), (2, 4)], ["float32"] * 3) == 0
    np.testing.assert_array_equal(y, np.full((2, 4), 3.0, np.float32))
    assert call([(2, 3), (1, 3, 4), (2, 4)], ["float16"] * 3) != 0
    assert call([(2, 3), (3, 4), (2, 4)], ["float32"] * 3) != 0      # an unpacked weight
    assert call([(2, 3), (1, 5, 4), (2, 4)], ["float32"] * 3) != 0
    assert call([(2, 3), (1, 3, 4), (2, 5)], ["float32"] * 3) != 0


@pytest.mark.slow
def test_build_is_cached_and_keyed(tmp_path, monkeypatch):
    """The one test that builds into an empty cache (every other kernel test shares the user's cache). Two of the
    sources stand for all of them: the caching and keying do not depend on which are compiled, and the whole
    library is built (then cached) by the first test that loads it."""
    monkeypatch.setattr(kbuild, "SOURCES", ("pack.cc", "vocab.cc"))
    first = kbuild.build_kernel(tmp_path, variant="scalar")
    assert first.exists() and first.parent == tmp_path and "scalar" in first.name
    mtime = first.stat().st_mtime_ns
    assert kbuild.build_kernel(tmp_path, variant="scalar") == first and first.stat().st_mtime_ns == mtime
    assert not [p for p in os.listdir(tmp_path) if p.startswith((".build-", ".src-"))]  # no temp files left
    monkeypatch.setattr(kbuild, "CXXFLAGS", kbuild.CXXFLAGS + ("-DMINDSERVE_TEST_FLAG",))
    assert kbuild.build_kernel(tmp_path, variant="scalar") != first  # flags are part of the key


def test_every_local_include_is_a_listed_header():
    """The build copies SOURCES + HEADERS (package data) to compile them: a header missing there breaks it."""
    files = kbuild.read_sources()
    included = {name for data in files.values() for name in re.findall(rb'#include "([^"]+)"', data)}
    assert {name.decode() for name in included} == set(kbuild.HEADERS)


def test_a_missing_source_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(kbuild, "SOURCES", kbuild.SOURCES + ("missing.cc",))
    with pytest.raises(kbuild.KernelBuildError, match="missing.cc are missing"):
        kbuild.build_kernel(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


def test_missing_compiler_is_a_clear_error(tmp_path):
    with pytest.raises(kbuild.KernelBuildError, match="no C\\+\\+ compiler"):
        kbuild.build_kernel(tmp_path, cxx="/nonexistent/g++")


def test_default_cache_dir_is_under_the_user_cache():
    assert kbuild.default_cache_dir() == kbuild.Path.home() / ".cache" / "mindserve" / "kernels"


@pytest.fixture(scope="module")
def ms_graph():
    ms = pytest.importorskip("mindspore")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        ms.set_device("CPU")
    except RuntimeError:
        pass  # the device may already be set by another test module in this process
    return ms


def test_op_inside_graph_mode_cell(ms_graph, cache_dir):
    ms = ms_graph
    from mindspore import Parameter, Tensor, nn, ops

    from backends.mindspore.kernels import fast_matmul, kernel_stats

    mm = fast_matmul(cache_dir)
    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((37, 53), dtype=np.float32)
    w2 = rng.standard_normal((53, 19), dtype=np.float32)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mm = mm
            self.w1 = Parameter(Tensor(prepare_weight(w1)), name="kt_w1", requires_grad=False)
            self.w2 = Parameter(Tensor(prepare_weight(w2)), name="kt_w2", requires_grad=False)
            self.w2_plain = Parameter(Tensor(w2), name="kt_w2_plain", requires_grad=False)

        def construct(self, x):
            h = ops.relu(self.mm(x, self.w1))
            return self.mm(h, self.w2), ops.matmul(h, self.w2_plain)

    net = Net()
    kernel_stats(reset=True)
    for shape in [(1, 37), (5, 37), (2, 3, 37)]:
        x = rng.standard_normal(shape, dtype=np.float32)
        fast, ref_ms = (t.asnumpy() for t in net(Tensor(x)))
        ref = np.maximum(x @ w1, 0) @ w2
        assert fast.shape == ref.shape
        assert np.abs(fast - ref).max() / np.abs(ref).max() < 1e-5
        assert np.abs(fast - ref_ms).max() / np.abs(ref).max() < 1e-5
    calls, _ = kernel_stats()
    assert calls == 6  # the graph really ran our kernel (2 per call), not a fallback
    assert ms.get_context("mode") == ms.GRAPH_MODE


def test_qkv_attention_writes_its_cache_parameters_in_place_in_graph_mode(ms_graph, cache_dir):
    """The fused attention op writes the K/V cache Parameters through their own memory: across steps of
    different compiled shapes (a 5-token prompt, a decode token, a 2-token chunk) every step attends over
    what the steps before it wrote, the Parameters read back (asnumpy) hold exactly the rows written, and
    reading them back does not undo a write (a stale host copy would be synced over the kernel's writes)."""
    from mindspore import Parameter, Tensor, nn

    from backends.mindspore.kernels import aot_ops
    from backends.mindspore.network.common import rope_tables

    h, kv, d, bs, num_blocks = 6, 2, 16, 4, 5
    ops_ = aot_ops(h, kv, d, cache_dir)
    rng = np.random.default_rng(12)
    slots = num_blocks * bs

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attend = ops_.qkv_attention
            self.k = Parameter(Tensor(np.zeros((kv * slots, d), np.float32)), name="kt_k_cache", requires_grad=False)
            self.v = Parameter(Tensor(np.zeros((kv * slots, d), np.float32)), name="kt_v_cache", requires_grad=False)
            self.bias = Tensor(np.zeros(1, np.float32))
            self.meta = Tensor(np.array([kv, bs, 0], np.int32))

        def construct(self, qkv, cos, sin, write, table, pos, rows):
            return self.attend(qkv, self.bias, cos, sin, self.k, self.v, write, table, pos, rows, self.meta)

    net = Net()
    table = np.array([[3, 1, 4]], np.int32)  # the sequence's blocks; block 0 stays the untouched scratch
    cos_t, sin_t = rope_tables(d, 3 * bs, 10000.0)
    want_k, want_v = np.zeros((kv * slots, d)), np.zeros((kv * slots, d))
    for start, n in [(0, 5), (5, 1), (6, 2)]:
        pos = np.arange(start, start + n, dtype=np.int32)
        slot = table[0, pos // bs].astype(np.int64) * bs + pos % bs
        write = (slot[:, None] + np.arange(kv) * slots).reshape(-1).astype(np.int32)
        qkv = rng.standard_normal((n, (h + 2 * kv) * d)).astype(np.float32)
        out = net(Tensor(qkv), Tensor(cos_t[pos]), Tensor(sin_t[pos]), Tensor(write), Tensor(table), Tensor(pos),
                  Tensor(np.zeros(n, np.int32))).asnumpy()
        split = qkv.astype(np.float64).reshape(n, h + 2 * kv, d)
        c, s_ = cos_t[pos][:, None].astype(np.float64), sin_t[pos][:, None].astype(np.float64)
        want_k[write] = _rope_ref(split[:, h:h + kv], c, s_).reshape(n * kv, d)
        want_v[write] = split[:, h + kv:].reshape(n * kv, d)
        want = _attention_ref(_rope_ref(split[:, :h], c, s_)[None], want_k, want_v, table, pos[None], kv, bs)[0]
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)
        np.testing.assert_allclose(net.k.asnumpy(), want_k, atol=2e-6, rtol=0)
        np.testing.assert_allclose(net.v.asnumpy(), want_v, atol=2e-6, rtol=0)
    assert not net.k.asnumpy()[:bs].any()  # the scratch block was never written


def test_graph_rows_bitwise_independent_of_batch(ms_graph, cache_dir):
    from mindspore import Parameter, Tensor, nn

    from backends.mindspore.kernels import fast_matmul

    mm = fast_matmul(cache_dir)
    rng = np.random.default_rng(4)
    w = rng.standard_normal((576, 960), dtype=np.float32)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mm = mm
            self.w = Parameter(Tensor(prepare_weight(w)), name="kt_w", requires_grad=False)

        def construct(self, x):
            return self.mm(x, self.w)

    net = Net()
    x = rng.standard_normal((20, 576), dtype=np.float32)
    batched = net(Tensor(x)).asnumpy()
    for m, i in [(1, 7), (16, 7), (20, 19)]:
        part = net(Tensor(x[:m] if m > 1 else x[i:i + 1])).asnumpy()
        assert np.array_equal(part[i if m > 1 else 0], batched[i]), (m, i)


# --- paged attention --------------------------------------------------------------------------

def _attention_ref(q, k, v, table, pos, kv, bs):
    """float64 NumPy: every query (b, t, h) attends keys 0..pos[b, t] of its row's blocks."""
    b_, t_, h_, d = q.shape
    s = k.shape[0] // kv
    out = np.zeros((b_, t_, h_ * d))
    for b in range(b_):
        for t in range(t_):
            n = min(int(pos[b, t]) + 1, table.shape[1] * bs)
            slots = table[b, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
            for h in range(h_):
                rows = (h // (h_ // kv)) * s + slots
                scores = k[rows].astype(np.float64) @ q[b, t, h] / np.sqrt(d)
                p = np.exp(scores - scores.max())
                out[b, t, h * d:(h + 1) * d] = (p / p.sum()) @ v[rows]
    return out


def _attention(lib, q, k, v, table, pos, kv, bs, rows=None):
    """q [B, T, H, D], pos [B, T]: token (b, t) belongs to table row b unless ``rows`` [B*T] says otherwise."""
    b, t, h, d = q.shape
    out = np.full((b, t, h * d), np.nan, np.float32)
    pos = np.ascontiguousarray(pos, np.int32).reshape(-1)
    rows = np.repeat(np.arange(b, dtype=np.int32), t) if rows is None else np.asarray(rows, np.int32)
    rc = lib.mindserve_attention_raw(q.ctypes.data, k.ctypes.data, v.ctypes.data, table.ctypes.data,
                                     pos.ctypes.data, rows.ctypes.data, out.ctypes.data, b * t, table.shape[0], h, d,
                                     kv, k.shape[0] // kv, table.shape[1], bs)
    return rc, out


def _attention_case(seed, b, t, h, kv, d, bs, nb, num_blocks, scale=1.0):
    rng = np.random.default_rng(seed)
    slots = num_blocks * bs
    k = (rng.standard_normal((kv * slots, d)) * scale).astype(np.float32)
    v = rng.standard_normal((kv * slots, d)).astype(np.float32)
    q = (rng.standard_normal((b, t, h, d)) * scale).astype(np.float32)
    table = rng.integers(0, num_blocks, (b, nb)).astype(np.int32)
    pos = rng.integers(0, nb * bs, (b, t)).astype(np.int32)
    return q, k, v, table, pos


# (batch, tokens, heads, kv heads, head dim, block size, table width): GQA 3:1 like SmolLM2, MHA,
# 7:1 like Qwen2.5-7B; head dims with a partial last vector; one block; keys past the table.
ATTN_CASES = [(1, 1, 9, 3, 64, 16, 4), (4, 1, 9, 3, 64, 16, 8), (2, 8, 4, 4, 32, 8, 5), (3, 5, 28, 4, 128, 16, 3),
              (2, 3, 6, 2, 40, 4, 7), (1, 4, 2, 1, 8, 1, 30), (5, 2, 3, 3, 17, 32, 1)]


@pytest.mark.parametrize("case", ATTN_CASES, ids=str)
def test_paged_attention_matches_numpy(lib, case):
    b, t, h, kv, d, bs, nb = case
    q, k, v, table, pos = _attention_case(sum(case), b, t, h, kv, d, bs, nb, num_blocks=nb * b + 2)
    rc, out = _attention(lib, q, k, v, table, pos, kv, bs)
    assert rc == 0
    np.testing.assert_allclose(out, _attention_ref(q, k, v, table, pos, kv, bs), atol=2e-5, rtol=0)


def test_paged_attention_softmax_is_stable_for_large_scores(lib):
    """Scores in the hundreds (exp would overflow without the max shift) still give the exact softmax."""
    q, k, v, table, pos = _attention_case(5, 2, 3, 4, 2, 64, 16, 4, num_blocks=10, scale=6.0)
    rc, out = _attention(lib, q, k, v, table, pos, 2, 16)
    assert rc == 0 and np.isfinite(out).all()
    np.testing.assert_allclose(out, _attention_ref(q, k, v, table, pos, 2, 16), atol=2e-5, rtol=0)


def test_paged_attention_reads_only_keys_up_to_pos(lib):
    """Keys after pos, and blocks the row does not own, may hold anything (even NaN): never read."""
    q, k, v, table, pos = _attention_case(9, 2, 2, 4, 2, 32, 8, 4, num_blocks=12)
    table[:] = [[1, 2, 3, 4], [5, 6, 7, 8]]
    pos[:] = [[0, 13], [7, 20]]
    expected = _attention_ref(q, k, v, table, pos, 2, 8)
    s = k.shape[0] // 2
    for head in range(2):
        for blk, last in ((1, None), (2, 13), (5, 7), (7, 20)):
            start = head * s + blk * 8 + ((last % 8) + 1 if last is not None else 8)
            k[start:head * s + (blk + 1) * 8] = np.nan
            v[start:head * s + (blk + 1) * 8] = np.nan
        for blk in (0, 3, 4, 8, 9, 10, 11):
            k[head * s + blk * 8: head * s + (blk + 1) * 8] = np.nan
            v[head * s + blk * 8: head * s + (blk + 1) * 8] = np.nan
    rc, out = _attention(lib, q, k, v, table, pos, 2, 8)
    assert rc == 0
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)


def test_paged_attention_rows_are_bit_identical_whatever_the_batch_and_threads(lib):
    q, k, v, table, pos = _attention_case(3, 6, 4, 9, 3, 64, 16, 6, num_blocks=40)
    _, batched = _attention(lib, q, k, v, table, pos, 3, 16)
    try:
        for threads in (1, 2, 3):
            lib.mindserve_matmul_set_threads(threads)
            for row in range(6):
                sl = slice(row, row + 1)
                _, alone = _attention(lib, np.ascontiguousarray(q[sl]), k, v, np.ascontiguousarray(table[sl]),
                                      np.ascontiguousarray(pos[sl]), 3, 16)
                assert np.array_equal(alone[0], batched[row])
    finally:
        lib.mindserve_matmul_set_threads(2)


def test_paged_attention_packs_tokens_of_several_sequences(lib):
    """A packed prompt chunk: tokens of three sequences side by side in one row, each with its own
    table row and positions, give what each sequence gives on its own."""
    q, k, v, table, _ = _attention_case(8, 1, 12, 4, 2, 32, 8, 4, num_blocks=16)
    table = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], np.int32)
    rows = np.array([0] * 5 + [1] * 3 + [2] * 4, np.int32)
    pos = np.array([[0, 1, 2, 3, 4, 17, 18, 19, 6, 7, 8, 9]], np.int32)
    rc, packed = _attention(lib, q, k, v, table, pos, 2, 8, rows=rows)
    assert rc == 0
    for seq, (lo, hi) in enumerate([(0, 5), (5, 8), (8, 12)]):
        rc, alone = _attention(lib, np.ascontiguousarray(q[:, lo:hi]), k, v, table[seq:seq + 1],
                               np.ascontiguousarray(pos[:, lo:hi]), 2, 8)
        assert rc == 0 and np.array_equal(alone[0], packed[0, lo:hi])
        np.testing.assert_allclose(alone, _attention_ref(q[:, lo:hi], k, v, table[seq:seq + 1], pos[:, lo:hi], 2, 8),
                                   atol=2e-5, rtol=0)


def test_paged_attention_refuses_a_block_or_row_outside_its_table(lib):
    q, k, v, table, pos = _attention_case(4, 2, 1, 4, 2, 16, 8, 3, num_blocks=5)
    for bad in (5, -1):
        bad_table = table.copy()
        bad_table[1, 2] = bad
        assert _attention(lib, q, k, v, bad_table, pos, 2, 8)[0] == 8
    for bad in (2, -1):
        assert _attention(lib, q, k, v, table, pos, 2, 8, rows=[0, bad])[0] == 9


# --- fused row kernels, called through their AOT entry points ------------------------------------

def _rope_ref(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("rows,cols", [(1, 576), (7, 33), (64, 576), (3, 16), (2, 5)])
def test_rmsnorm_kernel_matches_numpy(lib, rows, cols):
    rng = np.random.default_rng(rows * cols)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    y = np.full_like(x, np.nan)
    assert _aot_call(lib, "MindserveRMSNorm", [x, w, np.array([1e-5], np.float32)], [y]) == 0
    xd = x.astype(np.float64)
    np.testing.assert_allclose(y, xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-5) * w, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows,ffn", [(1, 1536), (5, 37), (64, 1536), (2, 16)])
def test_swiglu_kernel_matches_numpy(lib, rows, ffn):
    rng = np.random.default_rng(rows + ffn)
    gu = (rng.standard_normal((rows, 2 * ffn)) * 6).astype(np.float32)
    gu[0, :4] = [-120.0, 120.0, 0.0, -0.0]  # saturated and zero gates
    y = np.full((rows, ffn), np.nan, np.float32)
    assert _aot_call(lib, "MindserveSwiGLU", [gu], [y]) == 0
    g, u = gu[:, :ffn].astype(np.float64), gu[:, ffn:].astype(np.float64)
    np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows,heads,kv,d",
                         [(1, 9, 3, 64), (6, 4, 4, 32), (3, 28, 4, 128), (2, 3, 1, 40), (4, 2, 2, 6)])
def test_qkv_rope_kernel_matches_numpy(lib, rows, heads, kv, d):
    from backends.mindspore.network.common import rope_tables

    rng = np.random.default_rng(rows * heads + d)
    qkv = rng.standard_normal((rows, (heads + 2 * kv) * d)).astype(np.float32)
    cos_t, sin_t = rope_tables(d, 4096, 10000.0)
    pos = rng.integers(0, 4096, rows)
    cos, sin = cos_t[pos], sin_t[pos]
    q = np.full((rows, heads, d), np.nan, np.float32)
    k = np.full((rows * kv, d), np.nan, np.float32)
    v = np.full((rows * kv, d), np.nan, np.float32)
    assert _aot_call(lib, "MindserveQKVRope", [qkv, cos, sin], [q, k, v]) == 0
    split = qkv.astype(np.float64).reshape(rows, heads + 2 * kv, d)
    np.testing.assert_allclose(q, _rope_ref(split[:, :heads], cos[:, None], sin[:, None]), rtol=0, atol=2e-6)
    np.testing.assert_allclose(k.reshape(rows, kv, d),
                               _rope_ref(split[:, heads:heads + kv], cos[:, None], sin[:, None]),
                               rtol=0, atol=2e-6)
    assert np.array_equal(v.reshape(rows, kv, d), qkv.reshape(rows, heads + 2 * kv, d)[:, heads + kv:])


def _qkv_attention_case(seed, n, h, kv, d, bs, nb, num_blocks, bias: bool):
    """One packed step: n tokens of two sequences (table rows 0, 1), each token's K/V rows to write."""
    from backends.mindspore.network.common import rope_tables

    rng = np.random.default_rng(seed)
    width, slots = (h + 2 * kv) * d, num_blocks * bs
    qkv = rng.standard_normal((n, width)).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32) if bias else np.zeros(1, np.float32)
    k = rng.standard_normal((kv * slots, d)).astype(np.float32)
    v = rng.standard_normal((kv * slots, d)).astype(np.float32)
    table = np.stack([rng.permutation(np.arange(1, num_blocks))[:nb] for _ in range(2)]).astype(np.int32)
    rows = (np.arange(n) >= n // 2).astype(np.int32)  # the first half belongs to row 0, the rest to row 1
    start = rng.integers(0, nb * bs - n, 2)
    pos = np.array([start[r] + i for i, r in enumerate(rows)], np.int32)  # consecutive within each row
    slot = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
    write = (slot[:, None] + np.arange(kv) * slots).reshape(-1).astype(np.int32)
    cos_t, sin_t = rope_tables(d, nb * bs, 10000.0)
    meta = np.array([kv, bs, int(bias)], np.int32)
    return dict(qkv=qkv, bias=b, cos=cos_t[pos], sin=sin_t[pos], k=k, v=v, write=write, table=table, pos=pos,
                rows=rows, meta=meta)


def _qkv_attention(lib, c, h, d):
    """MindserveQKVAttention on copies of the caches: (rc, out, k after, v after)."""
    k, v = c["k"].copy(), c["v"].copy()
    out = np.full((len(c["qkv"]), h * d), np.nan, np.float32)
    rc = _aot_call(lib, "MindserveQKVAttention", [c["qkv"], c["bias"], c["cos"], c["sin"], k, v, c["write"],
                                                  c["table"], c["pos"], c["rows"], c["meta"], *c.get("norms", ())],
                   [out])
    # _aot_call passes k and v themselves (contiguous already): the kernel's in-place writes land in them
    return rc, out, k, v


QKV_ATTN_CASES = [(1, 9, 3, 64, 16, 4, False), (6, 9, 3, 64, 16, 4, False), (8, 4, 4, 32, 8, 5, True),
                  (5, 6, 2, 40, 4, 7, True), (4, 2, 1, 6, 2, 9, False)]


@pytest.mark.parametrize("n,h,kv,d,bs,nb,bias", QKV_ATTN_CASES)
def test_qkv_attention_writes_the_cache_then_attends_like_numpy(lib, n, h, kv, d, bs, nb, bias):
    """The fused kernel: the new K (roped) / V rows land in the caches, every other row is untouched, and each
    token attends over the updated cache, its own key and the earlier keys of its chunk included."""
    c = _qkv_attention_case(n * h + d, n, h, kv, d, bs, nb, nb * 2 + 3, bias)
    rc, out, k, v = _qkv_attention(lib, c, h, d)
    assert rc == 0
    x = c["qkv"].astype(np.float64) + (c["bias"] if bias else 0)
    split = x.reshape(n, h + 2 * kv, d)
    cos, sin = c["cos"][:, None].astype(np.float64), c["sin"][:, None].astype(np.float64)
    want_k, want_v = c["k"].astype(np.float64), c["v"].astype(np.float64)
    want_k[c["write"]] = _rope_ref(split[:, h:h + kv], cos, sin).reshape(n * kv, d)
    want_v[c["write"]] = split[:, h + kv:].reshape(n * kv, d)
    np.testing.assert_allclose(k, want_k, rtol=0, atol=2e-6)
    np.testing.assert_allclose(v, want_v, rtol=0, atol=2e-6)
    untouched = np.setdiff1d(np.arange(len(k)), c["write"])
    assert np.array_equal(k[untouched], c["k"][untouched]) and np.array_equal(v[untouched], c["v"][untouched])
    q = _rope_ref(split[:, :h], cos, sin)
    want = np.concatenate([_attention_ref(q[c["rows"] == r][None], want_k, want_v, c["table"][r:r + 1],
                                          c["pos"][c["rows"] == r][None], kv, bs)[0] for r in (0, 1)])
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("n,h,kv,d,bs,nb,bias", QKV_ATTN_CASES)
def test_qkv_attention_is_its_two_halves_bit_for_bit(lib, n, h, kv, d, bs, nb, bias):
    """Fused = (bias add,) MindserveQKVRope, the rows written, paged attention: the same bits, so the fused graph
    gives what the ScatterUpdate graph gave."""
    c = _qkv_attention_case(7 * n + d, n, h, kv, d, bs, nb, nb * 2 + 3, bias)
    rc, out, k, v = _qkv_attention(lib, c, h, d)
    assert rc == 0
    qkv = c["qkv"] + c["bias"] if bias else c["qkv"]  # one float32 add, as the graph's bias Add did
    q2 = np.full((n, h, d), np.nan, np.float32)
    k2, v2 = np.full((n * kv, d), np.nan, np.float32), np.full((n * kv, d), np.nan, np.float32)
    assert _aot_call(lib, "MindserveQKVRope", [qkv, c["cos"], c["sin"]], [q2, k2, v2]) == 0
    kc, vc = c["k"].copy(), c["v"].copy()
    kc[c["write"]], vc[c["write"]] = k2, v2
    assert np.array_equal(k, kc) and np.array_equal(v, vc)
    rc, want = _attention(lib, q2[None], kc, vc, c["table"], c["pos"][None], kv, bs, rows=c["rows"])
    assert rc == 0 and np.array_equal(out, want[0])


def test_qkv_attention_refuses_bad_inputs_and_writes_nothing_outside_the_cache(lib):
    c = _qkv_attention_case(3, 4, 4, 2, 16, 8, 3, 8, False)
    bad = dict(c, write=c["write"].copy())
    bad["write"][1] = len(c["k"])  # one row past the cache
    rc, _, k, v = _qkv_attention(lib, bad, 4, 16)
    assert rc == 8 and np.array_equal(k, c["k"]) and np.array_equal(v, c["v"])  # checked before any write
    assert _qkv_attention(lib, dict(c, table=np.full_like(c["table"], 99)), 4, 16)[0] == 8  # a block past the cache
    assert _qkv_attention(lib, dict(c, rows=np.array([0, 1, 2, 0], np.int32)), 4, 16)[0] == 9  # a row past the table
    assert _qkv_attention(lib, dict(c, meta=np.array([2, 8, 1], np.int32)), 4, 16)[0] == 4  # bias claimed, [1] given
    assert _qkv_attention(lib, dict(c, qkv=c["qkv"][:, :-16]), 4, 16)[0] == 4  # width is not (H + 2 KV) D
    assert _qkv_attention(lib, dict(c, pos=c["pos"].astype(np.float32)), 4, 16)[0] == 2
    eps = np.array([1e-6], np.float32)
    ones = np.ones((2, 16), np.float32)
    assert _qkv_attention(lib, dict(c, norms=(ones, eps)), 4, 16)[0] == 0  # the q/k head norms: [2, D] and eps
    assert _qkv_attention(lib, dict(c, norms=(ones,)), 4, 16)[0] == 1  # one of the two
    assert _qkv_attention(lib, dict(c, norms=(ones[:, :8], eps)), 4, 16)[0] == 4  # not D wide
    assert _qkv_attention(lib, dict(c, norms=(ones[:1], eps)), 4, 16)[0] == 4  # no k row
    assert _qkv_attention(lib, dict(c, norms=(ones, eps.astype(np.float64))), 4, 16)[0] == 2


@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (16, 1536, 576), (5, 37, 53), (20, 64, 100)])
def test_matmul_add_is_the_residual_plus_the_same_product(lib, m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed = prepare_weight(rng.standard_normal((k, n)).astype(np.float32))
    res = rng.standard_normal((m, n)).astype(np.float32)
    y = np.full((m, n), np.nan, np.float32)
    assert _aot_call(lib, "MindserveMatMulAdd", [x, packed, res], [y]) == 0
    assert np.array_equal(y, res + _mm(lib, x, packed))  # one float add after the identical product


def _lora_inputs(rng, m, k, n, slots=3, rank=4):
    """The four LoRA inputs of lora.h for one projection (G = 1): a, b, each row's slot (-1: none), segs."""
    a = rng.standard_normal((slots, k, rank)).astype(np.float32)
    b = rng.standard_normal((slots, rank, n)).astype(np.float32)
    rows = rng.integers(-1, slots, m).astype(np.int32)
    return [a, b, rows, np.array([0, n], np.int32)]


@pytest.mark.parametrize("m,k,n,lora", [(1, 576, 960, False), (16, 576, 3072, False), (5, 37, 53, True),
                                        (20, 64, 100, True)])
def test_norm_matmul_is_rmsnorm_then_the_matmul_bit_for_bit(lib, m, k, n, lora):
    rng = np.random.default_rng(m * k + n)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    nw, eps = rng.standard_normal(k).astype(np.float32), np.array([1e-5], np.float32)
    packed = prepare_weight(rng.standard_normal((k, n)).astype(np.float32))
    extra = _lora_inputs(rng, m, k, n) if lora else []
    y = np.full((m, n), np.nan, np.float32)
    assert _aot_call(lib, "MindserveNormMatMul", [x, nw, eps, packed, *extra], [y]) == 0
    normed = np.full_like(x, np.nan)
    assert _aot_call(lib, "MindserveRMSNorm", [x, nw, eps], [normed]) == 0
    want = np.full((m, n), np.nan, np.float32)
    assert _aot_call(lib, "MindserveMatMul", [normed, packed, *extra], [want]) == 0
    assert np.array_equal(y, want)


@pytest.mark.parametrize("m,f,n,lora", [(1, 1536, 576, False), (16, 1536, 576, False), (5, 37, 53, True),
                                        (20, 64, 100, True)])
def test_swiglu_matmul_add_is_swiglu_then_the_matmul_add_bit_for_bit(lib, m, f, n, lora):
    rng = np.random.default_rng(m * f + n)
    gu = (rng.standard_normal((m, 2 * f)) * 4).astype(np.float32)
    packed = prepare_weight(rng.standard_normal((f, n)).astype(np.float32))
    res = rng.standard_normal((m, n)).astype(np.float32)
    extra = _lora_inputs(rng, m, f, n) if lora else []
    y = np.full((m, n), np.nan, np.float32)
    assert _aot_call(lib, "MindserveSwiGLUMatMulAdd", [gu, packed, res, *extra], [y]) == 0
    act = np.full((m, f), np.nan, np.float32)
    assert _aot_call(lib, "MindserveSwiGLU", [gu], [act]) == 0
    want = np.full((m, n), np.nan, np.float32)
    assert _aot_call(lib, "MindserveMatMulAdd", [act, packed, res, *extra], [want]) == 0
    assert np.array_equal(y, want)


def test_fused_matmul_entries_pass_the_matmul_checks_through(lib):
    x, packed = np.zeros((2, 8), np.float32), prepare_weight(np.zeros((8, 5), np.float32))
    eps = np.array([1e-5], np.float32)
    assert _aot_call(lib, "MindserveNormMatMul", [x, np.zeros(7, np.float32), eps, packed],
                     [np.zeros((2, 5), np.float32)]) == 4  # norm weight of the wrong width
    assert _aot_call(lib, "MindserveNormMatMul", [x, np.zeros(8, np.float32), eps, packed],
                     [np.zeros((2, 6), np.float32)]) == 5  # the matmul's own output check
    out = [np.zeros((2, 5), np.float32)]
    odd = [np.zeros((2, 7), np.float32), packed, np.zeros((2, 5), np.float32)]
    assert _aot_call(lib, "MindserveSwiGLUMatMulAdd", odd, out) == 3  # an odd gate/up width
    short = [np.zeros((2, 16), np.float32), packed, np.zeros((3, 5), np.float32)]
    assert _aot_call(lib, "MindserveSwiGLUMatMulAdd", short, out) == 6


@pytest.mark.parametrize("bias", [False, True])
def test_decoder_layer_is_its_five_ops_bit_for_bit(lib, bias):
    """MindserveDecoderLayer = NormMatMul, QKVAttention, MatMulAdd, NormMatMul, SwiGLUMatMulAdd in order: the same
    output bits and the same cache rows as those five entries called one after the other."""
    h, kv, d, c, f = 4, 2, 16, 48, 40
    att = _qkv_attention_case(21 + bias, 6, h, kv, d, 4, 5, 13, bias)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, c)).astype(np.float32)
    na, nf = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    eps = np.array([1e-5], np.float32)
    wqkv = prepare_weight((rng.standard_normal((c, (h + 2 * kv) * d)) / 6).astype(np.float32))
    wo = prepare_weight((rng.standard_normal((h * d, c)) / 8).astype(np.float32))
    wgu = prepare_weight((rng.standard_normal((c, 2 * f)) / 6).astype(np.float32))
    wd = prepare_weight((rng.standard_normal((f, c)) / 6).astype(np.float32))
    cache = [att["write"], att["table"], att["pos"], att["rows"], att["meta"]]
    k1, v1 = att["k"].copy(), att["v"].copy()
    y = np.full_like(x, np.nan)
    inputs = [x, na, eps, wqkv, att["bias"], att["cos"], att["sin"], k1, v1, *cache, wo, nf, wgu, wd]
    assert _aot_call(lib, "MindserveDecoderLayer", inputs, [y]) == 0
    k2, v2 = att["k"].copy(), att["v"].copy()
    qkv = np.full((6, wqkv.shape[2]), np.nan, np.float32)
    assert _aot_call(lib, "MindserveNormMatMul", [x, na, eps, wqkv], [qkv]) == 0
    a = np.full((6, h * d), np.nan, np.float32)
    assert _aot_call(lib, "MindserveQKVAttention", [qkv, att["bias"], att["cos"], att["sin"], k2, v2, *cache], [a]) == 0
    hid = np.full_like(x, np.nan)
    assert _aot_call(lib, "MindserveMatMulAdd", [a, wo, x], [hid]) == 0
    gu = np.full((6, 2 * f), np.nan, np.float32)
    assert _aot_call(lib, "MindserveNormMatMul", [hid, nf, eps, wgu], [gu]) == 0
    want = np.full_like(x, np.nan)
    assert _aot_call(lib, "MindserveSwiGLUMatMulAdd", [gu, wd, hid], [want]) == 0
    assert np.array_equal(y, want) and np.array_equal(k1, k2) and np.array_equal(v1, v2)
    assert not np.array_equal(k1, att["k"])  # the layer wrote its cache rows
    bad = att["write"].copy()
    bad[0] = -1
    assert _aot_call(lib, "MindserveDecoderLayer", [x, na, eps, wqkv, att["bias"], att["cos"], att["sin"], k1, v1, bad,
                                                    *cache[1:], wo, nf, wgu, wd], [y]) == 208  # stage 2 names its error


def test_embed_rope_gathers_the_rows_of_every_token(lib):
    rng = np.random.default_rng(8)
    embed, cos_t, sin_t = (rng.standard_normal(s).astype(np.float32) for s in [(50, 24), (40, 8), (40, 8)])
    ids, pos = rng.integers(0, 50, (1, 7)).astype(np.int32), rng.integers(0, 40, (1, 7)).astype(np.int32)
    x = np.full((7, 24), np.nan, np.float32)
    cos, sin = np.full((7, 8), np.nan, np.float32), np.full((7, 8), np.nan, np.float32)
    assert _aot_call(lib, "MindserveEmbedRope", [ids, pos, embed, cos_t, sin_t], [x, cos, sin]) == 0
    assert np.array_equal(x, embed[ids[0]])
    assert np.array_equal(cos, cos_t[pos[0]]) and np.array_equal(sin, sin_t[pos[0]])
    bad = ids.copy()
    bad[0, 3] = 50
    assert _aot_call(lib, "MindserveEmbedRope", [bad, pos, embed, cos_t, sin_t], [x, cos, sin]) == 5
    assert _aot_call(lib, "MindserveEmbedRope", [ids, pos - 1 - pos.min(), embed, cos_t, sin_t], [x, cos, sin]) == 6


def test_norm_head_is_rmsnorm_gather_and_the_matmul_bit_for_bit(lib):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((10, 64)) * 2).astype(np.float32)
    nw, eps = rng.standard_normal(64).astype(np.float32), np.array([1e-5], np.float32)
    head = prepare_weight(rng.standard_normal((64, 300)).astype(np.float32))
    last = np.array([9, 2, 2, 0], np.int32)
    logits, hidden = np.full((4, 300), np.nan, np.float32), np.full_like(x, np.nan)
    assert _aot_call(lib, "MindserveNormHead", [x, nw, eps, last, head], [logits, hidden]) == 0
    normed = np.full_like(x, np.nan)
    assert _aot_call(lib, "MindserveRMSNorm", [x, nw, eps], [normed]) == 0
    assert np.array_equal(hidden, normed)
    assert np.array_equal(logits, _mm(lib, normed[last], head))
    assert _aot_call(lib, "MindserveNormHead", [x, nw, eps, np.array([10], np.int32), head],
                     [logits[:1], hidden]) == 7  # a logit row outside the chunk


def test_aot_entries_refuse_bad_shapes_and_dtypes(lib):
    f32 = np.zeros((2, 8), np.float32)
    assert _aot_call(lib, "MindserveRMSNorm", [f32, np.zeros(7, np.float32), np.zeros(1, np.float32)],
                     [np.zeros((2, 8), np.float32)]) == 4
    assert _aot_call(lib, "MindserveRMSNorm", [f32.astype(np.float64), np.zeros(8, np.float32),
                                              np.zeros(1, np.float32)], [np.zeros((2, 8), np.float32)]) == 2
    assert _aot_call(lib, "MindserveSwiGLU", [f32], [np.zeros((2, 3), np.float32)]) == 4
    assert _aot_call(lib, "MindserveQKVRope", [np.zeros((2, 40), np.float32), np.zeros((2, 4), np.float32),
                                              np.zeros((2, 4), np.float32)],
                     [np.zeros((2, 3, 4), np.float32), np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32)]) == 4
    packed = prepare_weight(np.zeros((8, 5), np.float32))
    assert _aot_call(lib, "MindserveMatMulAdd", [f32, packed, np.zeros((3, 5), np.float32)],
                     [np.zeros((2, 5), np.float32)]) == 6
