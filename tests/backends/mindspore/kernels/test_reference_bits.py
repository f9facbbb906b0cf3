"""Every kernel entry against the float32-exact NumPy reference (tests/support/kernel_ref.py), bit for bit: odd
shapes that leave a tail in every loop (16 lanes, 48-column panels, 8-row tiles, 32-weight blocks), inputs of
large dynamic range with exact and negative zeros and subnormals, every quantized format and segmented stacks of
several; on every build
variant of this machine's architecture, scalar included (a variant the CPU cannot run is skipped by name)."""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from backends.mindspore.kernels import prepare_qstack, prepare_qweight, prepare_weight
from backends.mindspore.modeldir.quant import BLOCK_BYTES, BLOCK_SIZE, QuantWeight
from backends.mindspore.modeldir.quant import quantize as quant_quantize
from tests.support.kernel_variants import HOST_VARIANTS, variant_lib
from tests.support import kernel_ref as ref
from tests.support import kv_ref
from tests.support.kernel_entries import call_aot as aot_call

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture(scope="module", params=HOST_VARIANTS)
def lib(kernel_cache, request):
    """This module's kernels: every variant, the scalar one too (its cases are small)."""
    return variant_lib(kernel_cache, request.param)


F32 = np.float32
QFORMATS = {"q8_0": (0, T.Q8_0), "q4_0": (1, T.Q4_0), "q4_1": (2, T.Q4_1), "q5_0": (3, T.Q5_0), "q5_1": (4, T.Q5_1)}
KQFORMATS = ("q4_k", "q5_k", "q6_k")
QCODES = {**{f: c for f, (c, _) in QFORMATS.items()}, "q4_k": 5, "q5_k": 6, "q6_k": 7}  # qmatmul.cc's Fmt
EPS = np.array([1e-5], F32)


def assert_bits(got: np.ndarray, want: np.ndarray) -> None:
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    assert got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    first = bad[:5]
    assert bad.size == 0, f"{bad.size} of {got.size} differ, first at {first}: {got.flat[first]} vs {want.flat[first]}"


def wild(rng: np.random.Generator, shape, spread: int = 12, scale: float = 1.0) -> np.ndarray:
    """Normal values times 2^U(-spread, spread), with ~5% +0.0, ~5% -0.0 and a few subnormals."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread + 1, shape)) * scale
    u = rng.random(shape)
    x = np.where(u < 0.05, 0.0, np.where(u < 0.10, -0.0, x))
    x = np.where((u > 0.10) & (u < 0.12), rng.standard_normal(shape) * 1e-40, x)
    return x.astype(F32)


def out(*shape) -> np.ndarray:
    return np.full(shape, np.nan, F32)


# --- matmul and LoRA ------------------------------------------------------------------------------

# (M, K, N): rows around the 8-row tiles, K odd, N around the 16-lane vectors and 48-column panels.
MATMUL = [(1, 1, 1), (3, 17, 5), (9, 33, 47), (17, 40, 49), (5, 100, 97), (20, 7, 150), (2, 64, 16)]


def lora_inputs(rng, m: int, k: int, n: int, slots: int = 3, rank: int = 4, groups: int = 1) -> ref.Lora:
    a = wild(rng, (slots, k, groups * rank), spread=4, scale=0.3)
    b = wild(rng, (slots, rank, n), spread=4, scale=0.3)
    rows = rng.integers(-1, slots, m).astype(np.int32)
    rows[0] = 1
    cuts = np.sort(rng.choice(np.arange(1, n), groups - 1, replace=False)) if groups > 1 else []
    segs = np.array([0, *cuts, n], np.int32)
    return ref.Lora(a, b, rows, segs)


def lora_list(lora: ref.Lora | None) -> list[np.ndarray]:
    return [] if lora is None else [lora.a, lora.b, lora.rows, lora.segs]


@pytest.mark.parametrize("m,k,n", MATMUL)
def test_matmul_raw_and_aot_entries(lib, m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    x, w, res = wild(rng, (m, k)), wild(rng, (k, n)), wild(rng, (m, n))
    packed = prepare_weight(w)
    want, want_add = ref.matmul(x, w), ref.matmul(x, w, res)
    y = out(m, n)
    lib.mindserve_matmul_raw(x.ctypes.data, packed.ctypes.data, y.ctypes.data, m, k, n)
    assert_bits(y, want)
    lib.mindserve_matmul_add_raw(x.ctypes.data, packed.ctypes.data, res.ctypes.data, y.ctypes.data, m, k, n)
    assert_bits(y, want_add)
    assert aot_call(lib, "MindserveMatMul", [x, packed], [y]) == 0
    assert_bits(y, want)
    assert aot_call(lib, "MindserveMatMulAdd", [x, packed, res], [y]) == 0
    assert_bits(y, want_add)


def test_matmul_fma_rounds_once_on_float32_midpoints(lib):
    """y = fma(a, b, fma(1, c, 0)) with a * b exactly halfway between two float32 values and c far below its ulp:
    a single rounding goes c's way, a float64 fma then a float32 cast rounds the tie to even (half of them wrong)."""
    rng = np.random.default_rng(12)
    a = ((rng.integers(2 ** 23, 2 ** 24, 20) | 1) * np.exp2(rng.integers(-10, 10, 20) - 23.0)).astype(F32)  # odd
    b = rng.choice(np.array([1.5, -1.5, 0.75, 3.0], F32), 50)
    c = (rng.choice([-1, 1], 50) * np.exp2(rng.integers(-60, -45, 50))).astype(F32)
    x = np.stack([np.ones(20, F32), a], 1)
    w = np.stack([c, b])
    y = out(20, 50)
    lib.mindserve_matmul_raw(x.ctypes.data, prepare_weight(w).ctypes.data, y.ctypes.data, 20, 2, 50)
    assert_bits(y, ref.matmul(x, w))
    naive = (a[:, None].astype(np.float64) * b + c).astype(F32)
    assert np.count_nonzero(naive.view(np.uint32) != y.view(np.uint32)) > 50


@pytest.mark.parametrize("m,k,n,groups,rank", [(1, 5, 3, 1, 1), (9, 33, 47, 3, 4), (17, 40, 70, 2, 8),
                                               (5, 17, 130, 1, 5)])
def test_matmul_with_lora_tail(lib, m, k, n, groups, rank):
    rng = np.random.default_rng(7 + m + n)
    x, w, res = wild(rng, (m, k)), wild(rng, (k, n)), wild(rng, (m, n))
    lora = lora_inputs(rng, m, k, n, rank=rank, groups=groups)
    packed = prepare_weight(w)
    y = out(m, n)
    lib.mindserve_matmul_lora_raw(x.ctypes.data, packed.ctypes.data, res.ctypes.data, y.ctypes.data, m, k, n,
                                  lora.a.ctypes.data, lora.b.ctypes.data, lora.rows.ctypes.data, lora.segs.ctypes.data,
                                  lora.a.shape[0], groups, rank)
    assert_bits(y, ref.product(x, w, res, lora))
    assert aot_call(lib, "MindserveMatMul", [x, packed, *lora_list(lora)], [y]) == 0
    assert_bits(y, ref.product(x, w, None, lora))
    assert aot_call(lib, "MindserveMatMulAdd", [x, packed, res, *lora_list(lora)], [y]) == 0
    assert_bits(y, ref.product(x, w, res, lora))


# --- quantized matmul -----------------------------------------------------------------------------

QMATMUL = [(1, 32, 1), (3, 64, 17), (9, 96, 33), (10, 160, 47)]
KQMATMUL = [(1, 256, 1), (3, 512, 17), (9, 768, 33), (10, 256, 47), (17, 512, 20),  # K a multiple of 256
            (2, 256, 64), (5, 512, 96), (16, 256, 80)]  # VNNI: one group at M=2, pairs of 2-4 rows (Q6_K: M >= 8)


def qweight(fmt: str, n: int, k: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-6, 2, (n, 1)))).astype(F32)
    w[:, :32] += 0.02 if fmt in ("q4_1", "q5_1", "q4_k", "q5_k") else 0.0  # an offset block: the mins matter
    w[0, -32:] = 0.0  # an all-zero weight block
    if fmt in KQFORMATS:  # the gguf package cannot write these: quant.quantize's own round-to-nearest
        return quant_quantize(w, fmt)
    blocks = gguf_quantize(w, QFORMATS[fmt][1])
    return QuantWeight(fmt, n, k, np.ascontiguousarray(blocks.reshape(n, -1)))


def random_blocks(fmt: str, n: int, k: int, seed: int) -> QuantWeight:
    """Blocks of random bytes (every bit pattern of quants, scales and high bits), with finite small fp16 scales."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // BLOCK_SIZE[fmt], BLOCK_BYTES[fmt]), dtype=np.uint8)
    scales = {"q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}[fmt]
    for lo in scales:
        b[..., lo:lo + 2] = (rng.standard_normal(b.shape[:2]) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    return QuantWeight(fmt, n, k, np.ascontiguousarray(b.reshape(n, -1)))


def qx(rng, m: int, k: int) -> np.ndarray:
    """Activations: wide range, an all-zero block, a block of -0.0, a block of exact rounding ties (x * id = n.5)."""
    x = wild(rng, (m, k), spread=10)
    x[0, :32] = 0.0
    if k >= 64:
        x[0, 32:64] = -0.0
    if m > 1:
        x[1, :32] = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -3.5, 126.5] * 4, F32)
    return x


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("m,k,n", QMATMUL)
def test_qmatmul_raw_and_aot_entries(lib, fmt, m, k, n):
    rng = np.random.default_rng(m + k + n)
    q = qweight(fmt, n, k, seed=k + n)
    x, res = qx(rng, m, k), wild(rng, (m, n))
    packed = prepare_qweight(q)
    code = QFORMATS[fmt][0]
    y = out(m, n)
    assert lib.mindserve_qmatmul_raw(x.ctypes.data, packed.ctypes.data, code, None, y.ctypes.data, m, k, n) == 0
    assert_bits(y, ref.qmatmul(x, q))
    assert lib.mindserve_qmatmul_raw(x.ctypes.data, packed.ctypes.data, code, res.ctypes.data, y.ctypes.data,
                                     m, k, n) == 0
    assert_bits(y, ref.qmatmul(x, q, res))
    assert aot_call(lib, "MindserveMatMul", [x, packed], [y]) == 0
    assert_bits(y, ref.qmatmul(x, q))
    lora = lora_inputs(rng, m, k, n, groups=1)
    assert aot_call(lib, "MindserveMatMulAdd", [x, packed, res, *lora_list(lora)], [y]) == 0
    assert_bits(y, ref.product(x, q, res, lora))


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1", *KQFORMATS])
@pytest.mark.parametrize("m,k,n", KQMATMUL)
@pytest.mark.parametrize("blocks", ["quantized", "random"])
def test_qmatmul_q5_and_k_quants(lib, fmt, m, k, n, blocks):
    """The 5- and 6-bit formats and the K-quants: blocks of a quantized matrix, and of random bytes (every high bit
    and 6-bit scale pattern; int8 Q6_K scales of both signs)."""
    rng = np.random.default_rng(m + k + n)
    q = qweight(fmt, n, k, seed=k + n) if blocks == "quantized" else random_blocks(fmt, n, k, seed=k + n)
    x, res = qx(rng, m, k), wild(rng, (m, n))
    packed = prepare_qweight(q)
    y = out(m, n)
    assert lib.mindserve_qmatmul_raw(x.ctypes.data, packed.ctypes.data, QCODES[fmt], res.ctypes.data,
                                     y.ctypes.data, m, k, n) == 0
    assert_bits(y, ref.qmatmul(x, q, res))
    assert aot_call(lib, "MindserveMatMul", [x, packed], [y]) == 0
    assert_bits(y, ref.qmatmul(x, q))
    lora = lora_inputs(rng, m, k, n, groups=1)
    assert aot_call(lib, "MindserveMatMulAdd", [x, packed, res, *lora_list(lora)], [y]) == 0
    assert_bits(y, ref.product(x, q, res, lora))


@pytest.mark.parametrize("fmt", list(QFORMATS))
def test_activation_scales_are_rounded_to_fp16(lib, fmt):
    """The 32-block formats take dx and dx * sum q as fp16 (llama.cpp's block_q8_0.d / block_q8_1.s): blocks whose
    dx or sum is an fp16 subnormal, a tie, far above 1 or beyond the fp16 range round as NumPy's float32 ->
    float16 (nearest, ties to even, inf)."""
    rng = np.random.default_rng(8)
    k = 32 * 9
    x = qx(rng, 4, k)
    for b, scale in enumerate([1e-9, 3e-8, 1e-7, 2e-6, 6e-5, 1e-3, 1.0, 300.0, 1e4]):
        blk = x[:, 32 * b:32 * (b + 1)]
        amax = np.abs(blk).max(-1, keepdims=True)
        blk *= np.where(amax > 0, np.float32(scale) / np.where(amax > 0, amax, 1), 1).astype(F32)  # zero blocks stay
    x[3, :32] = 0.0
    x[3, 0] = np.float32(127 * 2.0 ** -25)  # dx = 2^-25 exactly: an fp16 tie between 0 and 2^-24, to 0
    x[3, 32:64] = 0.0
    x[3, 32] = np.float32(127 * 3 * 2.0 ** -25)  # dx = 3 * 2^-25: a tie between 2^-24 and 2^-23, to 2^-23
    x[2, 224:256] = np.float32(3000)  # dx * sum q = 96000: beyond fp16, inf (so is Q4_1 / Q5_1's row, as llama.cpp's)
    q = qweight(fmt, 21, k, seed=9)
    y = out(4, 21)
    assert lib.mindserve_qmatmul_raw(x.ctypes.data, prepare_qweight(q).ctypes.data, QCODES[fmt], None,
                                     y.ctypes.data, 4, k, 21) == 0
    assert_bits(y, ref.qmatmul(x, q))
    want = ref.quantize_rows(x)
    assert want.d[3, 0] == 0 and want.d[3, 1] == 2.0 ** -23 and np.isinf(want.sf[2, 7])


def test_quantize_rows_k(lib):
    """Q8_K: per 256 values q = round-half-even(x * 127/amax), d = 1/(127/amax), the sums of each 16 q."""
    rng = np.random.default_rng(6)
    x = qx(rng, 4, 512)
    x[3, 256:] = 0.0  # an all-zero super-block: d 0
    q, d, bs = np.zeros((4, 512), np.int8), out(4, 2), np.zeros((4, 32), np.int32)
    assert lib.mindserve_quantize_rows_k_raw(x.ctypes.data, 4, 512, q.ctypes.data, d.ctypes.data,
                                             bs.ctypes.data) == 0
    want = ref.quantize_rows_k(x)
    assert np.array_equal(q.reshape(4, 2, 256), want.q) and np.array_equal(bs.reshape(4, 2, 16), want.bsums)
    assert_bits(d, want.d)
    assert d[3, 1] == 0 and np.abs(q).max() == 127


def test_quantize_rows(lib):
    rng = np.random.default_rng(4)
    x = qx(rng, 5, 160)
    q, d, s = np.zeros((5, 160), np.int8), out(5, 5), np.zeros((5, 5), np.int32)
    assert lib.mindserve_quantize_rows_raw(x.ctypes.data, 5, 160, q.ctypes.data, d.ctypes.data, s.ctypes.data) == 0
    want = ref.quantize_rows(x)
    assert np.array_equal(q.reshape(5, 5, 32), want.q) and np.array_equal(s, want.s)
    assert_bits(d, want.d)


@pytest.mark.parametrize("fmt", list(QCODES))
def test_qmatmul_block_of_tiny_amax(lib, fmt):
    """amax < 127 / FLT_MAX (~3.7e-37) would make id = 127 / amax infinite (x * id +-inf, NaN for a zero, which each
    ISA converts to a different integer): such a block quantizes to zeros, the same on every variant."""
    rng = np.random.default_rng(5)
    k = 256 if fmt in KQFORMATS else 64
    x = qx(rng, 3, k)
    x[2, :k // 2] = (rng.standard_normal(k // 2) * 1e-38).astype(F32)
    x[2, 5] = 0.0
    if fmt in KQFORMATS:
        x[2, k // 2:] = 0.0  # a whole super-block below 127 / FLT_MAX
    q = qweight(fmt, 17, k, seed=3)
    y = out(3, 17)
    assert lib.mindserve_qmatmul_raw(x.ctypes.data, prepare_qweight(q).ctypes.data, QCODES[fmt], None,
                                     y.ctypes.data, 3, k, 17) == 0
    assert_bits(y, ref.qmatmul(x, q))


# --- segmented stacks: parts in different formats (kernels.prepare_qstack) ------------------------------------------

STACKS = [  # (the parts' formats, their rows, K)
    (("q4_k", "q4_k", "q6_k"), (37, 5, 21), 512),  # Q4_K_M's qkv: q and k one Q4_K run, v Q6_K
    (("q5_k", "q4_k"), (33, 16), 256),  # a gate/up of two K-quants
    (("q4_1", "q8_0", "q5_1"), (20, 17, 1), 96),  # 32-block formats only, a one-column run
    (("q6_k", "q5_0", "q4_k", "q8_0"), (3, 40, 16, 9), 256),  # both activation kinds, runs of odd widths
    (("q5_0", "q5_0", "q8_0"), (24, 8, 8), 576)]  # a 576-wide Q4_K_M's fallbacks: Q5_0 q/k beside a Q8_0 v


def qstack(fmts, rows, k: int, seed: int) -> tuple[QuantWeight, ...]:
    return tuple(qweight(f, n, k, seed=seed + i) for i, (f, n) in enumerate(zip(fmts, rows)))


def parts_alone(lib, x: np.ndarray, parts) -> np.ndarray:
    """Each part multiplied alone by the kernel (its own packing), side by side."""
    ys = []
    for p in parts:
        ys.append(out(x.shape[0], p.rows))
        assert aot_call(lib, "MindserveMatMul", [x, prepare_qweight(p)], [ys[-1]]) == 0
    return np.concatenate(ys, axis=1)


@pytest.mark.parametrize("fmts,rows,k", STACKS)
@pytest.mark.parametrize("m", [1, 9, 17])
def test_qmatmul_segmented_stack(lib, fmts, rows, k, m):
    """Every output column of a segmented weight has the bits of its part multiplied alone (by the kernel, and by
    the reference); with the residual, and LoRA; through the raw and the AOT entries."""
    rng = np.random.default_rng(m + k)
    parts = qstack(fmts, rows, k, seed=k + m)
    packed = prepare_qstack(parts)
    n = sum(rows)
    assert packed.shape[0] == 1 and packed.shape[1] % 2 == 1 and packed.shape[2] == n
    x, res = qx(rng, m, k), wild(rng, (m, n))
    y = out(m, n)
    assert aot_call(lib, "MindserveMatMul", [x, packed], [y]) == 0
    assert_bits(y, parts_alone(lib, x, parts))
    assert_bits(y, ref.product(x, parts))
    assert lib.mindserve_qmatmul_packed_raw(x.ctypes.data, packed.ctypes.data, packed.shape[1], res.ctypes.data,
                                            y.ctypes.data, m, k, n) == 0
    assert_bits(y, ref.product(x, parts, res))
    lora = lora_inputs(rng, m, k, n, groups=1)
    assert aot_call(lib, "MindserveMatMulAdd", [x, packed, res, *lora_list(lora)], [y]) == 0
    assert_bits(y, ref.product(x, parts, res, lora))


def test_a_segmented_row_alone_gives_its_batched_bits(lib):
    rng = np.random.default_rng(8)
    parts = qstack(*STACKS[3], seed=2)
    packed, n = prepare_qstack(parts), sum(STACKS[3][1])
    x = qx(rng, 13, 256)
    y = out(13, n)
    assert aot_call(lib, "MindserveMatMul", [x, packed], [y]) == 0
    for r in (0, 6, 12):
        one = out(1, n)
        assert aot_call(lib, "MindserveMatMul", [x[r:r + 1], packed], [one]) == 0
        assert_bits(one[0], y[r])


def test_a_uniform_stack_keeps_the_single_format_layout():
    q, k = qweight("q4_k", 20, 256, seed=1), qweight("q4_k", 12, 256, seed=2)
    whole = QuantWeight("q4_k", 32, 256, np.concatenate([q.blocks, k.blocks]))
    np.testing.assert_array_equal(prepare_qstack([q, k]), prepare_qweight(whole))


def test_a_bad_segment_table_is_refused(lib):
    """Error 4 (no format's length, no valid table) for each broken field, never a read outside the weight."""
    parts = qstack(*STACKS[0], seed=1)
    packed, n = prepare_qstack(parts), sum(STACKS[0][1])
    x = qx(np.random.default_rng(1), 2, 512)
    assert aot_call(lib, "MindserveMatMul", [x, packed], [out(2, n)]) == 0
    table = packed.reshape(-1)[:8 + 16 * 2].copy()
    count, (f0, c0), (f1, c1) = table[4:8].view("<i4")[0], table[8:16].view("<i4"), table[24:32].view("<i4")
    assert (count, f0, c0, f1, c1) == (2, 5, 42, 7, 21)  # the runs: Q4_K q and k, Q6_K v
    for at, value, dtype in [(0, 0x5351534E, "<i4"), (4, 1, "<i4"), (4, 9, "<i4"), (8, 8, "<i4"), (12, 41, "<i4"),
                             (28, 22, "<i4"), (32, 8, "<i8"), (32, packed.size, "<i8"), (16, 7, "<i8")]:
        bad = packed.copy()
        bad.reshape(-1)[at:at + np.dtype(dtype).itemsize] = np.array([value], dtype).view(np.uint8)
        assert aot_call(lib, "MindserveMatMul", [x, bad], [out(2, n)]) == 4, (at, value)
    even = np.zeros((1, packed.shape[1] + 1, n), np.uint8)  # the table behind an even length: read as no table
    even.reshape(-1)[:packed.size] = packed.reshape(-1)
    assert aot_call(lib, "MindserveMatMul", [x, even], [out(2, n)]) == 4
    assert aot_call(lib, "MindserveMatMul", [x[:, :256], packed], [out(2, n)]) == 4  # another K: the sizes differ


# --- row kernels ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,c", [(1, 1), (3, 15), (2, 17), (5, 33), (4, 100)])
def test_rmsnorm(lib, n, c):
    rng = np.random.default_rng(n * 100 + c)
    x, w = wild(rng, (n, c)), wild(rng, c, spread=3)
    x[0, :] = 0.0  # an all-zero row: 1 / sqrt(eps)
    y = out(n, c)
    assert aot_call(lib, "MindserveRMSNorm", [x, w, EPS], [y]) == 0
    assert_bits(y, ref.rmsnorm(x, w, EPS[0]))


@pytest.mark.parametrize("n,f", [(1, 1), (3, 7), (2, 16), (4, 33), (2, 50)])
def test_swiglu(lib, n, f):
    rng = np.random.default_rng(n * 100 + f)
    gu = wild(rng, (n, 2 * f), spread=6)
    gu[0, :min(f, 4)] = np.array([-200.0, 120.0, -103.5, 88.0], F32)[:min(f, 4)]  # exp's clamp and underflow
    y = out(n, f)
    assert aot_call(lib, "MindserveSwiGLU", [gu], [y]) == 0
    assert_bits(y, ref.swiglu(gu))


@pytest.mark.parametrize("n,h,kv,d", [(1, 1, 1, 8), (3, 4, 2, 24), (2, 3, 1, 40), (2, 2, 2, 64)])
def test_qkv_rope(lib, n, h, kv, d):
    rng = np.random.default_rng(n + h + d)
    qkv = wild(rng, (n, (h + 2 * kv) * d), spread=6)
    cos, sin = wild(rng, (n, d), spread=1), wild(rng, (n, d), spread=1)
    q, k, v = out(n, h, d), out(n * kv, d), out(n * kv, d)
    assert aot_call(lib, "MindserveQKVRope", [qkv, cos, sin], [q, k, v]) == 0
    wq, wk, wv = ref.qkv_rope(qkv, cos, sin, h, kv)
    assert_bits(q, wq)
    assert_bits(k, wk.reshape(n * kv, d))
    assert_bits(v, wv.reshape(n * kv, d))


# --- attention ------------------------------------------------------------------------------------

def paged_case(rng, n: int, h: int, kv: int, d: int, bs: int, nb: int, num_blocks: int, table_rows: int = 2):
    """q [N, H, D], caches [KV S, D] (S = num_blocks * bs), a table of distinct blocks per row, pos including 0,
    the table's end, one past it (clamped) and a negative one (one key)."""
    q = wild(rng, (n, h, d), spread=3)
    k = wild(rng, (kv * num_blocks * bs, d), spread=3)
    v = wild(rng, (kv * num_blocks * bs, d), spread=6)
    table = np.stack([rng.permutation(num_blocks)[:nb] for _ in range(table_rows)]).astype(np.int32)
    pos = rng.integers(0, nb * bs, n).astype(np.int32)
    pos[: min(n, 4)] = np.array([0, nb * bs - 1, nb * bs + 5, -3], np.int32)[: min(n, 4)]
    rows = rng.integers(0, table_rows, n).astype(np.int32)
    return q, k, v, table, pos, rows


# (N, H, KV, D, bs, NB, blocks): head dims 8, 24, 40, 64; one and several kv heads; block sizes 1..16.
ATTENTION = [(1, 1, 1, 8, 1, 5, 7), (5, 4, 2, 24, 3, 7, 9), (4, 6, 3, 40, 16, 2, 3), (3, 2, 1, 64, 5, 8, 9),
             (6, 4, 4, 8, 7, 4, 6), (2, 3, 1, 24, 16, 4, 5)]


@pytest.mark.parametrize("n,h,kv,d,bs,nb,blocks", ATTENTION)
def test_paged_attention(lib, n, h, kv, d, bs, nb, blocks):
    rng = np.random.default_rng(n * h + d + bs)
    q, k, v, table, pos, rows = paged_case(rng, n, h, kv, d, bs, nb, blocks)
    want = ref.attention(q, k, v, table, pos, rows, kv, bs)
    y = out(n, h * d)
    assert lib.mindserve_attention_raw(q.ctypes.data, k.ctypes.data, v.ctypes.data, table.ctypes.data, pos.ctypes.data,
                                       rows.ctypes.data, y.ctypes.data, n, table.shape[0], h, d, kv, blocks * bs, nb,
                                       bs) == 0
    assert_bits(y, want)
    meta = np.array([kv, bs], np.int32)
    assert aot_call(lib, "MindservePagedAttention", [q, k, v, table, pos, rows, meta], [y]) == 0
    assert_bits(y, want)


# head dims 8, 24, 40 (q8_0: one partial block; one full and one partial), 64 (two full blocks)
@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "q8_0"])
@pytest.mark.parametrize("n,h,kv,d,bs,nb,blocks", ATTENTION[:4])
def test_paged_attention_kv_formats(lib, fmt, n, h, kv, d, bs, nb, blocks):
    """Caches stored in each kvCacheDtype format: the float32 arithmetic over the values they hold."""
    rng = np.random.default_rng(n * h + d + bs + kv_ref.CODES[fmt])
    q, k, v, table, pos, rows = paged_case(rng, n, h, kv, d, bs, nb, blocks)
    k, v = kv_ref.encode(k, fmt), kv_ref.encode(v, fmt)
    want = ref.attention(q, kv_ref.decode(k, fmt, d), kv_ref.decode(v, fmt, d), table, pos, rows, kv, bs)
    y = out(n, h * d)
    assert lib.mindserve_attention_kv_raw(q.ctypes.data, k.ctypes.data, v.ctypes.data, table.ctypes.data,
                                          pos.ctypes.data, rows.ctypes.data, y.ctypes.data, n, table.shape[0], h, d,
                                          kv, blocks * bs, nb, bs, kv_ref.CODES[fmt]) == 0
    assert_bits(y, want)
    meta = np.array([kv, bs], np.int32)
    y = out(n, h * d)
    assert aot_call(lib, "MindservePagedAttention", [q, k, v, table, pos, rows, meta], [y]) == 0
    assert_bits(y, want)


# Tokens in runs of one sequence at consecutive positions, as verify rows and prompt chunks come (the kernel attends
# a run's queries of one kv head together, converting the rows kTile at a time): (H, KV, D, run lengths); G = 3
# (SmolLM2), 4, 1, and 32 (over a group); head dims of the unrolled paths (64, 128) and of the run-time one.
VERIFY_RUNS = [(9, 3, 64, (8, 3, 1, 9, 2)), (8, 2, 40, (7, 1, 6)), (2, 2, 24, (16, 5)), (32, 1, 8, (3, 2)),
               (2, 1, 128, (24, 30, 1)), (2, 2, 64, (24, 24, 16))]


@pytest.mark.parametrize("fmt", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("h,kv,d,runs", VERIFY_RUNS)
def test_paged_attention_runs_of_one_sequence(lib, fmt, h, kv, d, runs):
    """Runs of consecutive positions of one table row (verify rows: 1 + k tokens; prompt chunks), alternating
    between two rows, some crossing a block boundary, with and without a sliding window: each query's bits are
    the reference's, as when it comes alone."""
    rng = np.random.default_rng(h * d + len(runs))
    bs, nb, blocks = 16, 6, 14
    q, k, v, table, _, _ = paged_case(rng, sum(runs), h, kv, d, bs, nb, blocks)
    pos = np.concatenate([rng.integers(0, nb * bs - r) + np.arange(r) for r in runs]).astype(np.int32)
    rows = np.concatenate([np.full(r, i % 2) for i, r in enumerate(runs)]).astype(np.int32)
    code = 0 if fmt == "float32" else kv_ref.CODES[fmt]
    if fmt != "float32":
        k, v = kv_ref.encode(k, fmt), kv_ref.encode(v, fmt)
    kd, vd = (k, v) if fmt == "float32" else (kv_ref.decode(k, fmt, d), kv_ref.decode(v, fmt, d))
    n = len(pos)
    for window in (0, 21):
        want = ref.attention(q, kd, vd, table, pos, rows, kv, bs, window=window)
        y = out(n, h * d)
        assert lib.mindserve_attention_window_raw(q.ctypes.data, k.ctypes.data, v.ctypes.data, table.ctypes.data,
                                                  pos.ctypes.data, rows.ctypes.data, y.ctypes.data, n, table.shape[0],
                                                  h, d, kv, blocks * bs, nb, bs, code, window, 0.0) == 0
        assert_bits(y, want)


def qkv_case(rng, n, h, kv, d, bs, nb, blocks, bias: bool):
    _, k, v, table, pos, rows = paged_case(rng, n, h, kv, d, bs, nb, blocks)
    qkv = wild(rng, (n, (h + 2 * kv) * d), spread=3)
    bias_v = wild(rng, (h + 2 * kv) * d, spread=2) if bias else np.zeros(1, F32)
    cos, sin = wild(rng, (n, d), spread=1), wild(rng, (n, d), spread=1)
    write = rng.choice(kv * blocks * bs, n * kv, replace=False).astype(np.int32)
    write[-kv:] = write[:kv] if n > 1 else write[-kv:]  # the last token writes the first one's rows: last wins
    cache = ref.Paged(k, v, write, table, pos, rows, kv, bs)
    return qkv, bias_v, cos, sin, cache, np.array([kv, bs, int(bias)], np.int32)


def head_norms(rng, d: int, on: bool) -> list[np.ndarray]:
    """QKVAttention's optional trailing inputs: the q and k head-norm weights [2, D] and their eps, or none."""
    return [wild(rng, (2, d), spread=2), EPS] if on else []


@pytest.mark.parametrize("fmt", kv_ref.FORMATS)
@pytest.mark.parametrize("bias,norm", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("n,h,kv,d,bs,nb,blocks", ATTENTION[1:5])
def test_qkv_attention(lib, n, h, kv, d, bs, nb, blocks, bias, norm, fmt):
    rng = np.random.default_rng(n + h + kv + d + bias + 2 * norm)
    qkv, bias_v, cos, sin, cache, meta = qkv_case(rng, n, h, kv, d, bs, nb, blocks, bias)
    cache = dataclasses.replace(cache, k=kv_ref.encode(cache.k, fmt), v=kv_ref.encode(cache.v, fmt), fmt=fmt)
    norms = head_norms(rng, d, norm)
    want, want_k, want_v = ref.qkv_attention(qkv, bias_v if bias else None, cos, sin, cache, h,
                                             *(norms[0], EPS[0]) if norm else ())
    k, v = cache.k.copy(), cache.v.copy()
    y = out(n, h * d)
    pos = cache.pos.reshape(1, n)  # the [1, N] form the graph passes
    assert aot_call(lib, "MindserveQKVAttention", [qkv, bias_v, cos, sin, k, v, cache.write, cache.table, pos,
                                                   cache.rows, meta, *norms], [y]) == 0
    assert_bits(y, want)
    assert_same(k, want_k)
    assert_same(v, want_v)


def gemma_meta(kv: int, bs: int, bias: bool, window: int, scale: float) -> np.ndarray:
    """QKVAttention's meta [5]: (KV, bs, has_bias, sliding window, the score scale's float32 bits)."""
    return np.array([kv, bs, int(bias), window, np.array([scale], F32).view(np.int32)[0]], np.int32)


# Gemma 3: sliding windows of 1 key, shorter than a block, across block boundaries, longer than any row (= none);
# the score scale from query_pre_attn_scalar (window 0 with a scale: a global layer).
@pytest.mark.parametrize("window,scalar", [(1, 24.0), (2, 32.0), (4, 256.0), (5, 168.0), (0, 24.0), (500, 24.0)])
@pytest.mark.parametrize("n,h,kv,d,bs,nb,blocks", [ATTENTION[1], ATTENTION[3], ATTENTION[4]])
def test_qkv_attention_window(lib, n, h, kv, d, bs, nb, blocks, window, scalar):
    rng = np.random.default_rng(n + h + kv + d + window)
    qkv, bias_v, cos, sin, cache, _ = qkv_case(rng, n, h, kv, d, bs, nb, blocks, False)
    scale = F32(scalar ** -0.5)
    cache = dataclasses.replace(cache, window=window, scale=scale)
    norms = head_norms(rng, d, True)
    want, want_k, want_v = ref.qkv_attention(qkv, None, cos, sin, cache, h, norms[0], EPS[0])
    k, v = cache.k.copy(), cache.v.copy()
    y = out(n, h * d)
    assert aot_call(lib, "MindserveQKVAttention", [qkv, bias_v, cos, sin, k, v, cache.write, cache.table, cache.pos,
                                                   cache.rows, gemma_meta(kv, bs, False, window, scale), *norms],
                    [y]) == 0
    assert_bits(y, want)
    assert_same(k, want_k)
    if window in (0, 500):  # no window: the plain kernel's bits when the scale is 1 / sqrt(D)'s
        plain, *_ = ref.qkv_attention(qkv, None, cos, sin, dataclasses.replace(cache, window=0), h, norms[0], EPS[0])
        assert_bits(y, plain)
    else:  # the window changes rows whose position is past it
        full, *_ = ref.qkv_attention(qkv, None, cos, sin, dataclasses.replace(cache, window=0), h, norms[0], EPS[0])
        assert not np.array_equal(y, full)


@pytest.mark.parametrize("fmt", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("n,kv", [(40, 4), (33, 2), (12, 3)])
def test_qkv_attention_rows_of_each_head(lib, n, kv, fmt):
    """The engine's write rows (head h of a token at row h S + its slot) with padding tokens that all write
    slot 0 of every head: the kernel writes the heads in parallel (enough tokens: several threads), and the last
    padding token's rows must still be the ones stored, and every query's bits the reference's."""
    h, d, bs, nb, blocks = 2 * kv, 24, 4, 12, 26
    rng = np.random.default_rng(n + kv)
    qkv, _, cos, sin, cache, meta = qkv_case(rng, n, h, kv, d, bs, nb, blocks, False)
    slot = rng.choice(np.arange(1, blocks * bs), n, replace=False)
    slot[n // 2::5] = 0  # padding tokens, in between and at the end: each writes slot 0 of every head
    slot[-1] = 0
    write = (slot[:, None] + np.arange(kv) * blocks * bs).reshape(-1).astype(np.int32)
    cache = dataclasses.replace(cache, write=write, k=kv_ref.encode(cache.k, fmt), v=kv_ref.encode(cache.v, fmt),
                                fmt=fmt)
    want, want_k, want_v = ref.qkv_attention(qkv, None, cos, sin, cache, h)
    k, v = cache.k.copy(), cache.v.copy()
    y = out(n, h * d)
    assert aot_call(lib, "MindserveQKVAttention", [qkv, np.zeros(1, F32), cos, sin, k, v, cache.write, cache.table,
                                                   cache.pos, cache.rows, meta], [y]) == 0
    assert_bits(y, want)
    assert_same(k, want_k)
    assert_same(v, want_v)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Stored caches, byte for byte."""
    assert got.shape == want.shape and got.dtype == want.dtype
    bad = np.flatnonzero(np.ascontiguousarray(got).view(np.uint8) != np.ascontiguousarray(want).view(np.uint8))
    assert bad.size == 0, f"{bad.size} bytes of {got.nbytes} differ, first at {bad[:5]}"


# Values at the edges of each format: float16's largest, its overflow midpoint (65520 rounds to inf), its
# smallest normal and subnormals, ties to even in both 16-bit formats, a zero q8_0 block, a block of subnormals.
EDGES = np.array([65504.0, 65519.0, 65520.0, -70000.0, 6.1035156e-05, 6.097555e-05, 5.9604645e-08, 2.9802322e-08,
                  2.9802326e-08, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8,
                  -0.0, 1e-40, 3.0e38], np.float32)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "q8_0"])
def test_kv_encoding_at_the_edges(lib, fmt):
    """The rows QKVAttention writes (V is stored as it comes: no rope), byte for byte against kv_ref's encoding."""
    n, h, kv, d, bs = 3, 1, 1, 48, 4
    qkv = np.zeros((n, (h + 2 * kv) * d), F32)
    qkv[0, 2 * d:] = np.resize(EDGES, d)
    qkv[1, 2 * d:] = np.resize(EDGES[::-1], d) * F32(1e-3)
    qkv[2, 2 * d:2 * d + 32] = F32(1e-41)  # a block of subnormals; the rest zero (a zero block)
    cos, sin = np.ones((n, d), F32), np.zeros((n, d), F32)
    table = np.array([[0, 1]], np.int32)
    pos, rows = np.arange(n, dtype=np.int32), np.zeros(n, np.int32)
    k, v = kv_ref.zeros(2 * bs, d, fmt), kv_ref.zeros(2 * bs, d, fmt)
    y = out(n, h * d)
    meta = np.array([kv, bs, 0], np.int32)
    with np.errstate(all="ignore"):
        assert aot_call(lib, "MindserveQKVAttention", [qkv, np.zeros(1, F32), cos, sin, k, v,
                                                       np.arange(n, dtype=np.int32), table, pos, rows, meta], [y]) == 0
    assert_same(v[:n], kv_ref.encode(qkv[:, 2 * d:], fmt))


# --- fused entries --------------------------------------------------------------------------------

def weight(rng, k: int, n: int, fmt: str | None):
    """(the reference's weight, the kernel's packed one): float32 [K, N], a quantized [N, K], or (``mixed``) a
    stack of parts in different formats."""
    if fmt is None:
        w = wild(rng, (k, n), spread=4, scale=0.3)
        return w, prepare_weight(w)
    if fmt == "mixed":  # a segmented stack of three 32-block formats
        rows = (n // 2, n // 4, n - n // 2 - n // 4)
        parts = qstack(("q4_1", "q8_0", "q5_1"), rows, k, seed=int(rng.integers(1000)))
        return parts, prepare_qstack(parts)
    q = qweight(fmt, n, k, seed=int(rng.integers(1000)))
    return q, prepare_qweight(q)


@pytest.mark.parametrize("fmt,lora", [(None, False), (None, True), ("q4_1", True), ("q8_0", False), ("mixed", True)])
@pytest.mark.parametrize("m,c,n", [(1, 32, 5), (9, 64, 47), (3, 96, 130)])
def test_norm_matmul(lib, m, c, n, fmt, lora):
    rng = np.random.default_rng(m + c + n)
    x, nw = wild(rng, (m, c)), wild(rng, c, spread=2)
    w, packed = weight(rng, c, n, fmt)
    lo = lora_inputs(rng, m, c, n, groups=2) if lora else None
    y = out(m, n)
    assert aot_call(lib, "MindserveNormMatMul", [x, nw, EPS, packed, *lora_list(lo)], [y]) == 0
    assert_bits(y, ref.norm_matmul(x, nw, EPS[0], w, lo))


@pytest.mark.parametrize("fmt,lora", [(None, False), (None, True), ("q4_0", False), ("q8_0", True), ("mixed", False)])
@pytest.mark.parametrize("m,f,n", [(1, 32, 5), (9, 64, 47), (3, 96, 50)])
def test_swiglu_matmul_add(lib, m, f, n, fmt, lora):
    rng = np.random.default_rng(m + f + n)
    gu, res = wild(rng, (m, 2 * f), spread=5), wild(rng, (m, n))
    w, packed = weight(rng, f, n, fmt)
    lo = lora_inputs(rng, m, f, n) if lora else None
    y = out(m, n)
    assert aot_call(lib, "MindserveSwiGLUMatMulAdd", [gu, packed, res, *lora_list(lo)], [y]) == 0
    assert_bits(y, ref.swiglu_matmul_add(gu, w, res, lo))


@pytest.mark.parametrize("fmt,bias,kv_fmt,norm", [
    (None, False, "float32", False), (None, True, "float32", False), ("q4_1", True, "float32", False),
    ("q4_1", True, "q8_0", False), (None, False, "float16", False), (None, False, "float32", True),
    ("q8_0", False, "float32", True), (None, False, "float16", True), ("mixed", True, "float32", False)])
def test_decoder_layer(lib, fmt, bias, kv_fmt, norm):
    h, kv, d, c, f, n = 4, 2, 24, 64, 96, 5
    rng = np.random.default_rng(11 + bias + 2 * norm)
    qkv_w, qkv_p = weight(rng, c, (h + 2 * kv) * d, fmt)
    wo, wo_p = weight(rng, h * d, c, None if fmt is None else "q8_0")
    wgu, wgu_p = weight(rng, c, 2 * f, fmt)
    wd, wd_p = weight(rng, f, c, fmt)
    _, bias_v, cos, sin, cache, meta = qkv_case(rng, n, h, kv, d, 3, 6, 8, bias)
    cache = dataclasses.replace(cache, k=kv_ref.encode(cache.k, kv_fmt), v=kv_ref.encode(cache.v, kv_fmt), fmt=kv_fmt)
    x, na, nf = wild(rng, (n, c), spread=4), wild(rng, c, spread=2), wild(rng, c, spread=2)
    norms = head_norms(rng, d, norm)
    want, want_k, want_v = ref.decoder_layer(x, na, EPS[0], qkv_w, bias_v if bias else None, cos, sin, cache, h, wo,
                                             nf, wgu, wd, *(norms[0], EPS[0]) if norm else ())
    k, v = cache.k.copy(), cache.v.copy()
    y = out(n, c)
    assert aot_call(lib, "MindserveDecoderLayer", [x, na, EPS, qkv_p, bias_v, cos, sin, k, v, cache.write, cache.table,
                                                   cache.pos, cache.rows, meta, wo_p, nf, wgu_p, wd_p, *norms],
                    [y]) == 0
    assert_bits(y, want)
    assert_same(k, want_k)
    assert_same(v, want_v)


@pytest.mark.parametrize("m,f,n", [(1, 32, 5), (9, 37, 47), (3, 96, 50)])
def test_geglu_matmul(lib, m, f, n):
    rng = np.random.default_rng(m + f + n + 1)
    gu = wild(rng, (m, 2 * f), spread=5)
    gu[0, :6] = [-120.0, 120.0, 0.0, -0.0, 1e30, -1e30]  # saturated both ways, zeros, a cube that overflows
    w, packed = weight(rng, f, n, None)
    y = out(m, n)
    with np.errstate(all="ignore"):
        assert aot_call(lib, "MindserveGeGLUMatMul", [gu, packed], [y]) == 0
        assert_bits(y, ref.product(ref.geglu(gu), w))


def test_geglu_is_gelu_tanh():
    """The reference's GeGLU against the textbook gelu_pytorch_tanh in float64 (the kernel's sigmoid form of it)."""
    g = np.linspace(-9, 9, 301, dtype=F32)
    gu = np.concatenate([g, np.ones_like(g)])[None]
    x = g.astype(np.float64)
    want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(ref.geglu(gu)[0], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("m,c", [(1, 16), (7, 45), (20, 64)])
def test_norm_add(lib, m, c):
    rng = np.random.default_rng(m + c)
    x, w, res = wild(rng, (m, c)), wild(rng, c, spread=2), wild(rng, (m, c))
    y = out(m, c)
    assert aot_call(lib, "MindserveNormAdd", [x, w, EPS, res], [y]) == 0
    assert_bits(y, ref.norm_add(x, w, EPS[0], res))
    assert aot_call(lib, "MindserveNormAdd", [x, w, EPS, y], [y]) == 5  # y may not alias res


@pytest.mark.parametrize("fmt,kv_fmt,window", [(None, "float32", 4), ("q8_0", "float32", 2), (None, "float16", 0),
                                               ("q4_1", "q8_0", 5)])
def test_gemma_decoder_layer(lib, fmt, kv_fmt, window):
    h, kv, d, c, f, n = 4, 2, 24, 64, 96, 5
    rng = np.random.default_rng(13 + window)
    qkv_w, qkv_p = weight(rng, c, (h + 2 * kv) * d, fmt)
    wo, wo_p = weight(rng, h * d, c, None if fmt is None else "q8_0")
    wgu, wgu_p = weight(rng, c, 2 * f, fmt)
    wd, wd_p = weight(rng, f, c, fmt)
    _, bias_v, cos, sin, cache, _ = qkv_case(rng, n, h, kv, d, 3, 6, 8, False)
    scale = F32(32.0 ** -0.5)
    cache = dataclasses.replace(cache, k=kv_ref.encode(cache.k, kv_fmt), v=kv_ref.encode(cache.v, kv_fmt), fmt=kv_fmt,
                                window=window, scale=scale)
    x = wild(rng, (n, c), spread=4)
    na, pan, nf, pfn = (wild(rng, c, spread=2) for _ in range(4))
    norms = head_norms(rng, d, True)
    want, want_k, want_v = ref.gemma_decoder_layer(x, na, EPS[0], qkv_w, None, cos, sin, cache, h, wo, pan, nf, wgu,
                                                   wd, pfn, norms[0], EPS[0])
    k, v = cache.k.copy(), cache.v.copy()
    y = out(n, c)
    with np.errstate(all="ignore"):
        assert aot_call(lib, "MindserveGemmaDecoderLayer",
                        [x, na, EPS, qkv_p, bias_v, cos, sin, k, v, cache.write, cache.table, cache.pos, cache.rows,
                         gemma_meta(kv, 3, False, window, scale), wo_p, pan, nf, wgu_p, wd_p, pfn, *norms], [y]) == 0
    assert_bits(y, want)
    assert_same(k, want_k)
    assert_same(v, want_v)


def test_embed_rope(lib):
    rng = np.random.default_rng(8)
    embed, cos_t, sin_t = wild(rng, (50, 24)), wild(rng, (40, 8)), wild(rng, (40, 8))
    ids, pos = rng.integers(0, 50, (1, 7)).astype(np.int32), rng.integers(0, 40, (1, 7)).astype(np.int32)
    x, cos, sin = out(7, 24), out(7, 8), out(7, 8)
    assert aot_call(lib, "MindserveEmbedRope", [ids, pos, embed, cos_t, sin_t], [x, cos, sin]) == 0
    for got, want in zip((x, cos, sin), ref.embed_rope(ids, pos, embed, cos_t, sin_t)):
        assert_bits(got, want)


@pytest.mark.parametrize("fmt", [None, "q4_0"])
def test_norm_head(lib, fmt):
    rng = np.random.default_rng(9)
    x, nw = wild(rng, (10, 64), spread=4), wild(rng, 64, spread=2)
    w, packed = weight(rng, 64, 131, fmt)
    last = np.array([9, 2, 2, 0], np.int32)
    logits, hidden = out(4, 131), out(10, 64)
    assert aot_call(lib, "MindserveNormHead", [x, nw, EPS, last, packed], [logits, hidden]) == 0
    want_logits, want_hidden = ref.norm_head(x, nw, EPS[0], last, w)
    assert_bits(hidden, want_hidden)
    assert_bits(logits, want_logits)


# --- moe.cc: routed experts (float32 and GGUF-block experts, top-1..3 of 5, normalised or not); an expert no row
# routes to is never read; a row alone gives its batched bits; the whole MoE decoder layer as its stages -------------
def experts(rng, e: int, c: int, f: int, fmt: str | None):
    """(the reference's per-expert gate/up and down weights, the kernel's stacked [E, ...] ones)."""
    gu_ref, d_ref, gu_p, d_p = [], [], [], []
    for i in range(e):
        if fmt is None:
            gu, d = wild(rng, (c, 2 * f), spread=3, scale=0.3), wild(rng, (f, c), spread=3, scale=0.3)
            gu_ref.append(gu), d_ref.append(d), gu_p.append(prepare_weight(gu)), d_p.append(prepare_weight(d))
        elif fmt == "mixed":  # gate Q4_1 beside up Q8_0: a segmented stack per expert
            gu = qstack(("q4_1", "q8_0"), (f, f), c, seed=100 * i + c)
            d = qweight("q4_0", c, f, seed=100 * i + f + 7)
            gu_ref.append(gu), d_ref.append(d), gu_p.append(prepare_qstack(gu)), d_p.append(prepare_qweight(d))
        else:
            gu, d = qweight(fmt, 2 * f, c, seed=100 * i + c), qweight(fmt, c, f, seed=100 * i + f + 7)
            gu_ref.append(gu), d_ref.append(d), gu_p.append(prepare_qweight(gu)), d_p.append(prepare_qweight(d))
    return gu_ref, d_ref, np.concatenate(gu_p), np.concatenate(d_p)


def moe_case(seed: int, n: int, c: int, f: int, e: int, fmt: str | None, router_fmt: str | None = None):
    rng = np.random.default_rng(seed)
    h, nw = wild(rng, (n, c), spread=4), wild(rng, c, spread=1)
    if router_fmt is None:
        router = wild(rng, (c, e), spread=2)
        router_p = prepare_weight(router)
    else:
        router = qweight(router_fmt, e, c, seed=seed)
        router_p = prepare_qweight(router)
    return (h, nw, router, router_p, *experts(rng, e, c, f, fmt))


MOE = [  # (N, C, F, E, top_k, norm, expert format, router format)
    (1, 45, 23, 5, 2, True, None, None), (7, 45, 23, 5, 1, False, None, None), (13, 64, 32, 5, 3, True, None, None),
    (6, 64, 32, 5, 2, True, "q8_0", None), (9, 64, 32, 5, 2, False, "q4_0", "q8_0"), (5, 96, 64, 5, 3, True, "q4_1",
                                                                                         None),
    (1, 64, 32, 8, 2, True, "q4_1", "q4_1"), (7, 64, 32, 5, 2, True, "mixed", None)]


@pytest.mark.parametrize("n,c,f,e,top_k,norm,fmt,router_fmt", MOE)
def test_moe(lib, n, c, f, e, top_k, norm, fmt, router_fmt):
    h, nw, router, router_p, gu_ref, d_ref, gu_p, d_p = moe_case(n + c + e, n, c, f, e, fmt, router_fmt)
    meta = np.array([top_k, int(norm)], np.int32)
    y = out(n, c)
    assert aot_call(lib, "MindserveMoE", [h, nw, EPS, router_p, gu_p, d_p, meta], [y]) == 0
    assert_bits(y, ref.moe(h, nw, EPS[0], router, gu_ref, d_ref, top_k, norm))


def test_route_weights_sum_to_one_and_pick_the_largest():
    """The reference's routing itself, against a plain float64 softmax and sort (ranks and normalised weights)."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((50, 8)) * 3).astype(F32)
    sel, weight = ref.route(logits, 3, True)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_array_equal(sel, np.argsort(-p, axis=1, kind="stable")[:, :3])
    top = np.take_along_axis(p, sel, 1)
    np.testing.assert_allclose(weight, top / top.sum(1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("fmt", [None, "q4_0"])
def test_unrouted_experts_are_never_read(lib, fmt):
    """Every expert no row routes to poisoned (NaN weights, or NaN block scales): the output is unchanged."""
    n, c, f, e = 3, 64, 32, 8
    h, nw, router, router_p, _, _, gu_p, d_p = moe_case(5, n, c, f, e, fmt)
    meta = np.array([2, 1], np.int32)
    y = out(n, c)
    assert aot_call(lib, "MindserveMoE", [h, nw, EPS, router_p, gu_p, d_p, meta], [y]) == 0
    sel, _ = ref.route(ref.product(ref.rmsnorm(h, nw, EPS[0]), router), 2, True)
    unused = sorted(set(range(e)) - set(sel.ravel().tolist()))
    assert unused
    gu_bad, d_bad = gu_p.copy(), d_p.copy()
    for i in unused:
        if fmt is None:
            gu_bad[i], d_bad[i] = np.nan, np.nan
        else:
            gu_bad[i], d_bad[i] = 0xFF, 0xFF  # fp16 0xFFFF scales: NaN
    y2 = out(n, c)
    assert aot_call(lib, "MindserveMoE", [h, nw, EPS, router_p, gu_bad, d_bad, meta], [y2]) == 0
    assert np.isfinite(y2).all()
    assert_bits(y2, y)


@pytest.mark.parametrize("fmt", [None, "q8_0"])
def test_a_row_alone_gives_its_batched_bits(lib, fmt):
    n, c, f, e = 11, 64, 32, 6
    h, nw, _, router_p, _, _, gu_p, d_p = moe_case(9, n, c, f, e, fmt)
    meta = np.array([2, 1], np.int32)
    y = out(n, c)
    assert aot_call(lib, "MindserveMoE", [h, nw, EPS, router_p, gu_p, d_p, meta], [y]) == 0
    for r in (0, 5, 10):
        one = out(1, c)
        assert aot_call(lib, "MindserveMoE", [h[r:r + 1], nw, EPS, router_p, gu_p, d_p, meta], [one]) == 0
        assert_bits(one[0], y[r])


def test_moe_refuses_bad_shapes(lib):
    h, nw, _, router_p, _, _, gu_p, d_p = moe_case(1, 2, 64, 32, 4, None)
    for meta in ([0, 1], [5, 1]):  # top_k outside 1..E
        assert aot_call(lib, "MindserveMoE", [h, nw, EPS, router_p, gu_p, d_p, np.array(meta, np.int32)],
                        [out(2, 64)]) != 0
    assert aot_call(lib, "MindserveMoE", [h, nw, EPS, router_p, gu_p[:3], d_p, np.array([2, 1], np.int32)],
                    [out(2, 64)]) != 0  # experts of gate/up and down disagree


@pytest.mark.parametrize("fmt,kv_fmt,norm", [(None, "float32", True), ("q4_1", "float16", True),
                                             ("q8_0", "float32", False)])
def test_moe_decoder_layer(lib, fmt, kv_fmt, norm):
    h, kv, d, c, f, e, n, top_k = 4, 2, 24, 64, 32, 5, 5, 2
    rng = np.random.default_rng(21 + 2 * norm)
    qfmt = None if fmt is None else "q8_0"
    wqkv = qweight(qfmt, (h + 2 * kv) * d, c, seed=1) if qfmt else wild(rng, (c, (h + 2 * kv) * d), spread=3,
                                                                         scale=0.3)
    wo = wild(rng, (h * d, c), spread=3, scale=0.3)
    pack = prepare_qweight if qfmt else prepare_weight
    _, bias_v, cos, sin, cache, meta = qkv_case(rng, n, h, kv, d, 3, 6, 8, False)
    cache = dataclasses.replace(cache, k=kv_ref.encode(cache.k, kv_fmt), v=kv_ref.encode(cache.v, kv_fmt), fmt=kv_fmt)
    x, na, nf = wild(rng, (n, c), spread=4), wild(rng, c, spread=2), wild(rng, c, spread=1)
    router = wild(rng, (c, e), spread=2)
    gu_ref, d_ref, gu_p, d_p = experts(rng, e, c, f, fmt)
    norms = head_norms(rng, d, norm)
    want, want_k, want_v = ref.moe_decoder_layer(x, na, EPS[0], wqkv, None, cos, sin, cache, h, wo, nf, router,
                                                 gu_ref, d_ref, top_k, True, *(norms[0], EPS[0]) if norm else ())
    k, v = cache.k.copy(), cache.v.copy()
    y = out(n, c)
    mm = np.array([top_k, 1], np.int32)
    assert aot_call(lib, "MindserveMoEDecoderLayer",
                    [x, na, EPS, pack(wqkv), bias_v, cos, sin, k, v, cache.write, cache.table, cache.pos, cache.rows,
                     meta, prepare_weight(wo), nf, prepare_weight(router), gu_p, d_p, mm, *norms], [y]) == 0
    assert_bits(y, want)
    assert_same(k, want_k)
    assert_same(v, want_v)
