"""The quantized AOT matmul (qmatmul.cc) against NumPy: Q8_0, Q4_0, Q4_1 GGUF blocks (made and dequantized by
the `gguf` package, not by the code under test), odd sizes, residual, row determinism; on every SIMD variant
(the ``lib`` fixture; test_variants.py proves the variants give the same bits).

Two references:
* ``emulate``: the kernel's documented arithmetic (qmatmul.cc header) in NumPy -- the activations quantized
  per row and block of 32, exact integer block sums, then acc = fma(d_w * d_x, sum, acc) (+ fma(m_w, s_x, acc)
  for Q4_1) block after block, d_x = fp16(amax / 127) and s_x = fp16(amax / 127 * sum qx) (llama.cpp's Q8_0 /
  Q8_1 activation blocks), the fma emulated in float64 and rounded to float32. Float64 holds
  d_w * d_x * sum exactly (24 + 20 bits), so the only difference left is a double rounding (float64 then
  float32) of the sum, at most one float32 ulp of the accumulator per block and rare; the test allows
  nb ulps of the largest partial sum's magnitude.
* ``x @ dequant(W)`` in float64, without activation quantization: the kernel must be within the bound that
  quantizing x implies, |sum_k (x_k - dx*qx_k) w_k| <= sum_b (dx_b / 2) * sum_{k in b} |w_k|, plus what the fp16
  d_x and s_x add (``fp16_bound``) and float32 slack (1e-5 of sum |x_k w_k|).
"""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from backends.mindspore.kernels import prepare_qweight
from backends.mindspore.modeldir.quant import BLOCK_BYTES, QuantWeight, dequantize
from tests.support import act_quant_ref

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

FORMATS = {"q8_0": (0, T.Q8_0), "q4_0": (1, T.Q4_0), "q4_1": (2, T.Q4_1)}
ODD = [(1, 32, 1), (3, 64, 17), (9, 96, 33), (17, 32, 100), (5, 576, 15), (20, 160, 48), (2, 1536, 7)]
MODEL = [(1, 576, 960), (16, 576, 576), (4, 1536, 576), (3, 576, 3072)]


def _weight(fmt: str, n: int, k: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, :32] += 0.02 if fmt == "q4_1" else 0.0  # an offset block, so Q4_1's min matters
    blocks = gguf_quantize(w, FORMATS[fmt][1])
    return QuantWeight(fmt, n, k, np.ascontiguousarray(blocks.reshape(n, -1)))


def _x(m: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (amax 0)
    return x


def _qmm(lib, x, q: QuantWeight, res=None, packed=None) -> np.ndarray:
    packed = prepare_qweight(q) if packed is None else packed
    m, k = x.shape
    y = np.full((m, q.rows), np.nan, np.float32)
    rc = lib.mindserve_qmatmul_raw(x.ctypes.data, packed.ctypes.data, FORMATS[q.fmt][0],
                                   None if res is None else res.ctypes.data, y.ctypes.data, m, k, q.rows)
    assert rc == 0
    return y


def _fp16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).astype(np.float32)


def _quantize_x(x: np.ndarray):
    """q [M, nb, 32] int64, d [M, nb] float32: amax/127 (unrounded), q = rint(x * (127/amax)) in float32."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    return q, (amax / np.float32(127)).astype(np.float32)


def _blocks(q: QuantWeight):
    """Integer weights [N, nb, 32] (Q4_0 centred: q - 8), d and m [N, nb] float32, straight from the bytes."""
    b = q.blocks.reshape(q.rows, -1, BLOCK_BYTES[q.fmt])
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = np.zeros_like(d)
    if q.fmt == "q8_0":
        return b[..., 2:].view(np.int8).astype(np.int64), d, m
    qs = b[..., 4:] if q.fmt == "q4_1" else b[..., 2:]
    nib = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    if q.fmt == "q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return nib, d, m
    return nib - 8, d, m


def emulate(x: np.ndarray, q: QuantWeight, res=None) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's arithmetic (module docstring) and the largest |partial sum| of each element."""
    qx, d = _quantize_x(x)
    qw, dw, mw = _blocks(q)
    isum = np.einsum("mbk,nbk->mnb", qx, qw)  # exact
    dx, sx = _fp16(d), _fp16((d * qx.sum(-1).astype(np.float32)).astype(np.float32))  # [M, nb]
    acc = np.zeros((x.shape[0], q.rows), np.float32)
    peak = np.zeros_like(acc)
    for b in range(qx.shape[1]):
        scale = (dw[None, :, b] * dx[:, None, b]).astype(np.float32)
        acc = (scale.astype(np.float64) * isum[:, :, b] + acc).astype(np.float32)
        if q.fmt == "q4_1":
            acc = (mw[None, :, b].astype(np.float64) * sx[:, None, b] + acc).astype(np.float32)
        peak = np.maximum(peak, np.abs(acc))
    if res is not None:
        acc = (acc + res).astype(np.float32)
    return acc, peak


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", ODD + MODEL)
def test_matches_the_emulated_arithmetic(lib, fmt, m, k, n):
    q, x = _weight(fmt, n, k, seed=k + n), _x(m, k, seed=m)
    y = _qmm(lib, x, q)
    ref, peak = emulate(x, q)
    ulp = np.spacing(np.maximum(peak, np.float32(1e-30)))
    assert np.all(np.abs(y - ref) <= (k // 32) * ulp), np.max(np.abs(y - ref) / ulp)
    assert np.mean(y == ref) > 0.99  # a double rounding is rare: nearly every element is bit-identical


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", ODD + MODEL[:2])
def test_within_the_activation_quantization_bound_of_x_at_dequantized_w(lib, fmt, m, k, n):
    q, x = _weight(fmt, n, k, seed=3 * n + k), _x(m, k, seed=m + 7)
    wd = gguf_dequantize(q.blocks, FORMATS[fmt][1]).reshape(n, k).astype(np.float64)
    np.testing.assert_array_equal(dequantize(q), wd.astype(np.float32))  # the loader's dequantizer agrees
    y = _qmm(lib, x, q).astype(np.float64)
    exact = x.astype(np.float64) @ wd.T
    _, dx = _quantize_x(x)
    absw = np.abs(wd).reshape(n, -1, 32).sum(-1)  # [N, nb]
    bound = (dx.astype(np.float64) / 2) @ absw.T + fp16_bound(x, q, wd) + 1e-5 * (np.abs(x) @ np.abs(wd).T)
    assert np.all(np.abs(y - exact) <= bound)


def fp16_bound(x: np.ndarray, q: QuantWeight, wd: np.ndarray) -> np.ndarray:
    """What the fp16 d_x and s_x may add for a 32-block format (wd: the dequantized weight [N, K]): each rounding
    is within 2^-11 of its value, so 2^-11 sum_b (dx_b sum_k |qx_k (w_k - m_b)| + |dx_b sum_k qx_k| |m_b|)
    bounds it, m_b the block's min (Q4_1, Q5_1; else 0)."""
    qx, d = _quantize_x(x)
    m = act_quant_ref.block_mins(q.fmt, q.blocks)
    m = np.zeros((q.rows, q.cols // 32)) if m is None else m
    xq = np.abs(qx * d[..., None].astype(np.float64)).reshape(x.shape[0], -1)  # [M, K]
    wq = np.abs(wd - np.repeat(m, 32, axis=1))
    sx = np.abs(d.astype(np.float64) * qx.sum(-1))  # [M, nb]
    return 2.0 ** -11 * (1 + 1e-6) * (xq @ wq.T + sx @ np.abs(m).T)


KFORMATS = {"q5_0": (3, T.Q5_0), "q5_1": (4, T.Q5_1), "q4_k": (5, T.Q4_K), "q5_k": (6, T.Q5_K), "q6_k": (7, T.Q6_K)}


@pytest.mark.parametrize("fmt", KFORMATS)
@pytest.mark.parametrize("m,k,n", [(1, 256, 1), (3, 512, 17), (16, 1536, 40), (5, 2048, 33)])
def test_q5_and_k_quants_within_the_activation_quantization_bound(lib, fmt, m, k, n):
    """The Q5 formats and the K-quants against x @ W with W dequantized by the gguf package (an independent
    reader of the GGUF layouts): within what quantizing x implies, per block of 32 (dx = amax / 127, plus
    fp16_bound) or, for the K-quants, per 256 (dx = 1 / (127 / amax)), |error| <= sum_b (dx_b / 2) sum_{k in b} |w_k|
    (+ float32 slack)."""
    from backends.mindspore.modeldir.quant import quantize

    rng = np.random.default_rng(k + n)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, :32] += 0.03  # an offset block: the mins matter
    q = quantize(w, fmt)
    x = _x(m, k, seed=m + 11)
    wd = gguf_dequantize(q.blocks, KFORMATS[fmt][1]).reshape(n, k).astype(np.float64)
    np.testing.assert_array_equal(dequantize(q), wd.astype(np.float32))  # the loader's dequantizer agrees
    packed = prepare_qweight(q)
    y = np.full((m, n), np.nan, np.float32)
    assert lib.mindserve_qmatmul_raw(x.ctypes.data, packed.ctypes.data, KFORMATS[fmt][0], None, y.ctypes.data,
                                     m, k, n) == 0
    exact = x.astype(np.float64) @ wd.T
    block = 256 if fmt.endswith("_k") else 32
    amax = np.abs(x.astype(np.float64)).reshape(m, -1, block).max(-1)
    absw = np.abs(wd).reshape(n, -1, block).sum(-1)
    bound = (amax / 127 / 2) @ absw.T * (1 + 1e-6) + 1e-5 * (np.abs(x) @ np.abs(wd).T)
    if block == 32:
        bound += fp16_bound(x, q, wd)
    assert np.all(np.abs(y - exact) <= bound)
    assert np.max(np.abs(y - exact)) > 0  # the activations are quantized (the bound is not vacuous)


@pytest.mark.parametrize("fmt", FORMATS)
def test_residual_is_added_once_after_the_product(lib, fmt):
    q, x = _weight(fmt, 37, 96, seed=1), _x(5, 96, seed=2)
    res = np.random.default_rng(3).standard_normal((5, 37)).astype(np.float32)
    np.testing.assert_array_equal(_qmm(lib, x, q, res), (_qmm(lib, x, q) + res).astype(np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_are_bit_identical_alone_or_batched(lib, fmt, threads):
    lib.mindserve_matmul_set_threads(threads)
    try:
        q, x = _weight(fmt, 200, 576, seed=5), _x(21, 576, seed=6)
        packed = prepare_qweight(q)
        batched = _qmm(lib, x, q, packed=packed)
        for i in range(x.shape[0]):
            assert np.array_equal(_qmm(lib, x[i:i + 1].copy(), q, packed=packed)[0], batched[i])
        assert np.array_equal(_qmm(lib, x[3:12].copy(), q, packed=packed), batched[3:12])
    finally:
        lib.mindserve_matmul_set_threads(2)


def test_activation_quantization_matches_numpy(lib):
    x = _x(7, 160, seed=9)
    x[1, 40] = 1e-30  # a tiny block
    q = np.zeros((7, 160), np.int8)
    d = np.zeros((7, 5), np.float32)
    s = np.zeros((7, 5), np.int32)
    assert lib.mindserve_quantize_rows_raw(x.ctypes.data, 7, 160, q.ctypes.data, d.ctypes.data, s.ctypes.data) == 0
    qx, dx = _quantize_x(x)
    np.testing.assert_array_equal(q.reshape(7, 5, 32), qx)
    np.testing.assert_array_equal(d, _fp16(dx))  # d as llama.cpp's block_q8_0 stores it
    np.testing.assert_array_equal(s, qx.sum(-1))


def test_prepare_qweight_layout():
    """Group 0, block 0 of a q4_1 weight: 4 quant dwords x 16 columns, then 16 d, then 16 m (fp16)."""
    q = _weight("q4_1", 20, 64, seed=4)
    packed = prepare_qweight(q)
    assert packed.shape == (1, 2 * 20, 20) and packed.dtype == np.uint8
    flat, b = packed.ravel(), q.blocks.reshape(20, 2, 20)
    for j in range(4):
        for c in range(16):
            assert bytes(flat[(j * 16 + c) * 4:(j * 16 + c + 1) * 4]) == bytes(b[c, 0, 4 + 4 * j:8 + 4 * j])
    assert bytes(flat[256:288]) == b"".join(bytes(b[c, 0, 0:2]) for c in range(16))
    assert bytes(flat[288:320]) == b"".join(bytes(b[c, 0, 2:4]) for c in range(16))
    tail = 16 * 2 * 20  # the last group (4 columns) starts after the full one
    assert bytes(flat[tail:tail + 4]) == bytes(b[16, 0, 4:8])


def test_aot_entry_dispatches_on_a_uint8_weight_and_checks_it(lib):
    q, x = _weight("q8_0", 4, 64, seed=8), _x(2, 64, seed=8)
    packed = prepare_qweight(q)
    y = np.zeros((2, 4), np.float32)
    params = (ctypes.c_void_p * 3)(x.ctypes.data, packed.ctypes.data, y.ctypes.data)

    def call(shapes, dtypes):
        ndims = (ctypes.c_int * 3)(*[len(s) for s in shapes])
        arrs = [(ctypes.c_int64 * len(s))(*s) for s in shapes]
        sp = (ctypes.POINTER(ctypes.c_int64) * 3)(*[ctypes.cast(a, ctypes.POINTER(ctypes.c_int64)) for a in arrs])
        dt = (ctypes.c_char_p * 3)(*[d.encode() for d in dtypes])
        return lib.MindserveMatMul(3, params, ndims, sp, dt, None, None)

    assert call([(2, 64), (1, 68, 4), (2, 4)], ["float32", "uint8", "float32"]) == 0
    np.testing.assert_array_equal(y, _qmm(lib, x, q))
    assert call([(2, 64), (1, 70, 4), (2, 4)], ["float32", "uint8", "float32"]) != 0  # no format has 35 bytes
    assert call([(2, 63), (1, 68, 4), (2, 4)], ["float32", "uint8", "float32"]) != 0  # K not a multiple of 32
    assert call([(2, 64), (1, 68, 4), (2, 5)], ["float32", "uint8", "float32"]) != 0


def _entry(lib, name: str, arrays: list[np.ndarray], dtypes: list[str]) -> int:
    """Call an AOT entry on plain arrays (the last one is the output)."""
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    sp = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes])
    dt = (ctypes.c_char_p * n)(*[d.encode() for d in dtypes])
    return getattr(lib, name)(n, params, ndims, sp, dt, None, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_tail_after_a_quantized_product(lib, fmt):
    """MindserveMatMulAdd(x, W uint8, res, a, b, rows, segs): the quantized product plus the residual, then each
    row's LoRA delta (lora.h) -- the delta against float64 NumPy, base rows (slot -1) bit-identical."""
    rng = np.random.default_rng(11)
    m, k, segs, rank = 5, 576, [0, 576, 768, 960], 8
    q, x = _weight(fmt, segs[-1], k, seed=12), _x(m, k, seed=13)
    res = rng.standard_normal((m, segs[-1])).astype(np.float32)
    a = (rng.standard_normal((2, k, 3 * rank)) / np.sqrt(k)).astype(np.float32)
    b = (rng.standard_normal((2, rank, segs[-1])) / np.sqrt(rank)).astype(np.float32)
    rows = np.array([0, -1, 1, 0, -1], np.int32)
    seg = np.array(segs, np.int32)
    y = np.full((m, segs[-1]), np.nan, np.float32)
    packed = prepare_qweight(q)
    assert _entry(lib, "MindserveMatMulAdd", [x, packed, res, a, b, rows, seg, y],
                  ["float32", "uint8", "float32", "float32", "float32", "int32", "int32", "float32"]) == 0
    base = _qmm(lib, x, q, res)
    for i, s in enumerate(rows):
        if s < 0:
            assert np.array_equal(y[i], base[i])
            continue
        t = x[i].astype(np.float64) @ a[s].astype(np.float64)
        delta = np.concatenate([t[g * rank:(g + 1) * rank] @ b[s][:, segs[g]:segs[g + 1]].astype(np.float64)
                                for g in range(3)])
        np.testing.assert_allclose(y[i] - base[i].astype(np.float64), delta, atol=1e-4, rtol=1e-4)
