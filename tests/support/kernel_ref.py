"""Executable float32-exact NumPy reference of every CPU kernel (backends/mindspore/kernels): each function
follows its kernel's operation sequence step by step in 16-lane vectors with zero-filled tails, so the AVX-512
library (and any port of it) must match it bit for bit.

Float32 fma is ``fma32`` (exact product, TwoSum, one rounding); horizontal sums are the fixed halving tree of
GCC's ``_mm512_reduce_add_ps``; max is x86 ``maxps`` (a > b ? a : b). Weights are given unpacked: float32
``[K, N]``, a ``QuantWeight``, or a tuple of ``QuantWeight`` parts stacked along their outputs (a segmented
weight: each part in its own format).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.mindspore.modeldir.quant import QuantWeight, unpack
from tests.support import kv_ref

F32 = np.float32
LANES = 16
_ONE = F32(1)


# --- arithmetic primitives ------------------------------------------------------------------------

def fma32(a, b, c) -> np.ndarray:
    """a * b + c rounded once to float32 (arrays broadcast; subnormals, signed zeros and overflow as IEEE)."""
    a, b, c = (np.asarray(v, F32) for v in (a, b, c))
    with np.errstate(all="ignore"):
        p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 + 24 bits, no underflow in float64
        c64 = c.astype(np.float64)
        s = p + c64
        bv = s - p
        err = (p - (s - bv)) + (c64 - bv)  # TwoSum: s + err == p + c exactly
        r = s.astype(F32)
        # Double rounding: s exactly halfway between two float32 values while the exact sum is not.
        big = np.float64(2.0 ** 128)  # where float32 rounding overflows, the "value" above FLT_MAX
        r64 = np.where(np.isinf(r) & np.isfinite(s), np.copysign(big, s), r.astype(np.float64))
        other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf)).astype(F32))
        mid = (r64 + other.astype(np.float64)) * 0.5
        tie = (s != r64) & (s == mid) & (err != 0) & np.isfinite(err)
        fixed = np.where((err > 0) == (other.astype(np.float64) > r64), other, r)
        return np.where(tie, fixed, r).astype(F32)


def reduce_add16(v: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps over the last axis (16 lanes): i + i+8, i + i+4, i + i+2, lane 0 + lane 1."""
    v = v[..., 8:] + v[..., :8]
    v = v[..., 4:] + v[..., :4]
    v = v[..., :2] + v[..., 2:]
    return (v[..., 0] + v[..., 1]).astype(F32)


def maxps(a, b) -> np.ndarray:
    """x86 max: a if a > b else b (so max(+0, -0) = -0 and a NaN operand gives b)."""
    return np.where(a > b, a, b).astype(F32)


def reduce_max16(v: np.ndarray) -> np.ndarray:
    """_mm512_reduce_max_ps over the last axis, the same halving tree as reduce_add16 with maxps(hi, lo)."""
    v = maxps(v[..., 8:], v[..., :8])
    v = maxps(v[..., 4:], v[..., :4])
    v = maxps(v[..., :2], v[..., 2:])
    return maxps(v[..., 0], v[..., 1])


def pad16(x: np.ndarray) -> np.ndarray:
    """The last axis zero-filled to whole vectors (a masked load gives +0.0 in the dead lanes)."""
    n = x.shape[-1]
    width = max(LANES, -(-n // LANES) * LANES)
    return np.concatenate([x, np.zeros(x.shape[:-1] + (width - n,), F32)], -1).astype(F32)


def vec_sum(x: np.ndarray) -> np.ndarray:
    """16 lane-wise accumulators added chunk by chunk (vsum = vsum + chunk), then reduce_add16."""
    chunks = pad16(x).reshape(x.shape[:-1] + (-1, LANES))
    acc = np.zeros(x.shape[:-1] + (LANES,), F32)
    for c in range(chunks.shape[-2]):
        acc = acc + chunks[..., c, :]
    return reduce_add16(acc)


def vec_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """attention.cc dot() / rmsnorm's sum of squares: acc = fma(a, b, acc) per 16-lane chunk, then the tree."""
    a, b = np.broadcast_arrays(pad16(a), pad16(b))
    a = a.reshape(a.shape[:-1] + (-1, LANES))
    b = b.reshape(b.shape[:-1] + (-1, LANES))
    acc = np.zeros(a.shape[:-2] + (LANES,), F32)
    for c in range(a.shape[-2]):
        acc = fma32(a[..., c, :], b[..., c, :], acc)
    return reduce_add16(acc)


_EXP_POLY = [F32(1.0 / 720), F32(1.0 / 120), F32(1.0 / 24), F32(1.0 / 6), F32(0.5), _ONE, _ONE]


def exp_nonpositive(x) -> np.ndarray:
    """simd.h exp_nonpositive: max with -103, n = rint(x log2e), r by two fnmadd, degree-7 Horner, p * 2^n."""
    x = maxps(np.asarray(x, F32), F32(-103.0))
    n = np.rint(x * F32(1.44269504088896341)).astype(F32)
    r = fma32(-n, F32(0.693359375), x)
    r = fma32(-n, F32(-2.12194440e-4), r)
    p = np.full_like(x, F32(1.0 / 5040))
    for coeff in _EXP_POLY:
        p = fma32(p, r, coeff)
    with np.errstate(over="ignore"):  # only lanes the kernels discard can exceed 0 (and overflow)
        return np.ldexp(p, n.astype(np.int32)).astype(F32)  # scalef: one rounding (checked by test_kernel_ref)


# --- matmul, LoRA, quantized matmul ---------------------------------------------------------------

@dataclass(frozen=True)
class Lora:
    """lora.h's four inputs: a [S, K, G*R], b [S, R, N], rows [M] (slot or -1), segs [G + 1]."""

    a: np.ndarray
    b: np.ndarray
    rows: np.ndarray
    segs: np.ndarray


def matmul(x: np.ndarray, w: np.ndarray, res: np.ndarray | None = None) -> np.ndarray:
    """matmul.cc: acc = 0; acc = fma(x[m, k], W[k, n], acc) for k in order; then + res once."""
    x, w = np.asarray(x, F32), np.asarray(w, F32)
    acc = np.zeros((x.shape[0], w.shape[1]), F32)
    for k in range(x.shape[1]):
        acc = fma32(x[:, k, None], w[None, k, :], acc)
    return acc if res is None else (acc + res).astype(F32)


def lora_apply(y: np.ndarray, x: np.ndarray, lora: Lora) -> np.ndarray:
    """lora.cc: t = fma chain over k of x[m, k] a[s, k, j]; per column, fma chain over j of t[g R + j] b[s, j, n],
    then one add into y. Rows of slot -1 are left as they are."""
    y = np.array(y, F32)
    live = np.flatnonzero(lora.rows >= 0)
    if live.size == 0:
        return y
    slots = lora.rows[live]
    a, b = lora.a[slots], lora.b[slots]  # [L, K, GR], [L, R, N]
    t = np.zeros((live.size, a.shape[2]), F32)
    for k in range(a.shape[1]):
        t = fma32(x[live, k, None], a[:, k, :], t)
    rank, n = b.shape[1], b.shape[2]
    group = np.searchsorted(lora.segs, np.arange(n), side="right") - 1  # g(n)
    acc = np.zeros((live.size, n), F32)
    for j in range(rank):
        acc = fma32(t[:, group * rank + j], b[:, j, :], acc)
    y[live] = y[live] + acc
    return y


@dataclass(frozen=True)
class QuantizedX:
    """quantize.cc quantize_rows: q [M, nb, 32] int8 values, the int32 lanes before narrowing, d, s and sf [M, nb]
    (d and sf: fp16 values in float32)."""

    q: np.ndarray
    lanes: np.ndarray
    d: np.ndarray
    s: np.ndarray
    sf: np.ndarray


def _wrap32(v: np.ndarray) -> np.ndarray:
    return ((v.astype(np.int64) + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int64)


def quantize_rows(x: np.ndarray) -> QuantizedX:
    """quantize_block: amax, id = 127/amax (0 if amax is 0 or 127/amax is not finite: a block of values below
    127/FLT_MAX quantizes to zeros), lanes = round-half-even(x * id), q = the lanes (within -127..127), s = the
    sum of the lanes; as llama.cpp's x86 quantize_row_q8_0 / q8_1 store them (block_q8_0.d, block_q8_1.s):
    d = fp16(amax / 127), sf = fp16((amax / 127) * (float)s), NumPy's float32 -> float16 (nearest, ties to even,
    inf beyond the fp16 range)."""
    xb = np.asarray(x, F32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    with np.errstate(all="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
        inv = np.where(np.isfinite(inv), inv, F32(0)).astype(F32)
        lanes = np.rint((xb * inv[..., None]).astype(F32)).astype(np.int64)
    q = np.clip(lanes, -128, 127)
    d, s = (amax / F32(127)).astype(F32), _wrap32(lanes.sum(-1))
    with np.errstate(over="ignore"):
        sf = (d * s.astype(F32)).astype(F32).astype(np.float16).astype(F32)
        return QuantizedX(q, lanes, d.astype(np.float16).astype(F32), s, sf)


@dataclass(frozen=True)
class QuantizedXK:
    """quantize.cc quantize_rows_k (Q8_K): q [M, nb, 256] int8 values, d [M, nb], bsums [M, nb, 16]."""

    q: np.ndarray
    d: np.ndarray
    bsums: np.ndarray


def quantize_rows_k(x: np.ndarray) -> QuantizedXK:
    """quantize_superblock: amax over 256, iscale = 127/amax (0 if amax is 0 or 127/amax is not finite),
    q = round-half-even(x * iscale), d = 1/iscale (0 with iscale 0), bsums of each 16."""
    xb = np.asarray(x, F32).reshape(x.shape[0], -1, 256)
    amax = np.abs(xb).max(-1)
    with np.errstate(all="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
        inv = np.where(np.isfinite(inv), inv, F32(0)).astype(F32)
        lanes = np.rint((xb * inv[..., None]).astype(F32)).astype(np.int64)
        d = np.where(inv != 0, _ONE / inv, F32(0)).astype(F32)
    q = np.clip(lanes, -128, 127)
    return QuantizedXK(q, d, q.reshape(q.shape[0], q.shape[1], 16, 16).sum(-1))


def _qmatmul_k(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    """qtile.h ktile for the K-quants: per super-block b in order (exact int sums)
    q4_k/q5_k: isum = sum_j sc_j dot_j, imin = sum_j mn_j (bsum_2j + bsum_2j+1);
               acc = fma(d_w dx, (float)isum, acc); acc = fma(-(dmin_w dx), (float)imin, acc)
    q6_k:      isum = sum_j sc_j (dot16_j - 32 bsum_j); acc = fma(d_w dx, (float)isum, acc)."""
    qx = quantize_rows_k(np.asarray(x, F32))
    p = unpack(w)
    nb = qx.d.shape[1]
    acc = np.zeros((x.shape[0], w.rows), F32)
    if w.fmt == "q6_k":
        u = p.u.reshape(w.rows, nb, 16, 16)
        dots = np.einsum("mbjk,nbjk->mnbj", qx.q.reshape(x.shape[0], nb, 16, 16), u)  # [M, N, nb, 16]
        isum = (p.sc[None] * (dots - 32 * qx.bsums[:, None])).sum(-1)
    else:
        u = p.u.reshape(w.rows, nb, 8, 32)
        dots = np.einsum("mbjk,nbjk->mnbj", qx.q.reshape(x.shape[0], nb, 8, 32), u)
        isum = (p.sc[None] * dots).sum(-1)
        pair = qx.bsums.reshape(x.shape[0], nb, 8, 2).sum(-1)  # [M, nb, 8]
        imin = np.einsum("nbj,mbj->mnb", p.mn, pair).astype(F32)
    isum = _wrap32(isum).astype(F32)
    for b in range(nb):
        acc = fma32((p.d[None, :, b] * qx.d[:, None, b]).astype(F32), isum[:, :, b], acc)
        if w.fmt != "q6_k":
            acc = fma32(-(p.m[None, :, b] * qx.d[:, None, b]).astype(F32), imin[:, :, b], acc)
    return acc


def qmatmul(x: np.ndarray, w: QuantWeight, res: np.ndarray | None = None) -> np.ndarray:
    """qmatmul.cc: per block b in order, isum = exact int32 sum of u * qx (- 128 s for Q8_0, - 8 s for Q4_0,
    - 16 s for Q5_0); acc = fma(d_w * dx, (float)isum, acc); Q4_1 / Q5_1 also acc = fma(m_w, sf, acc);
    the K-quants as _qmatmul_k; then + res once."""
    if w.fmt.endswith("_k"):
        acc = _qmatmul_k(x, w)
        return acc if res is None else (acc + res).astype(F32)
    qx = quantize_rows(np.asarray(x, F32))
    p = unpack(w)
    u = p.u.reshape(w.rows, -1, 32)
    isum = np.einsum("mbk,nbk->mnb", qx.q, u)
    isum = _wrap32(isum - p.offset * qx.s[:, None, :]).astype(F32)  # cvtepi32_ps: nearest even
    acc = np.zeros((x.shape[0], w.rows), F32)
    for b in range(qx.d.shape[1]):
        acc = fma32((p.d[None, :, b] * qx.d[:, None, b]).astype(F32), isum[:, :, b], acc)
        if p.m is not None:
            acc = fma32(p.m[None, :, b], qx.sf[:, None, b], acc)
    return acc if res is None else (acc + res).astype(F32)


def qmatmul_stack(x: np.ndarray, parts: tuple[QuantWeight, ...], res: np.ndarray | None = None) -> np.ndarray:
    """qmatmul.cc's segmented weight: each part's columns exactly as ``qmatmul`` of that part alone (its own
    format's activation quantization and steps), side by side; then + res once."""
    acc = np.concatenate([qmatmul(x, p) for p in parts], axis=-1)
    return acc if res is None else (acc + res).astype(F32)


def product(x, w, res=None, lora: Lora | None = None) -> np.ndarray:
    """The matmul entries: a float32 [K, N], a quantized weight or a stack of quantized parts, (+ res), then each
    row's LoRA delta."""
    if isinstance(w, tuple):
        y = qmatmul_stack(x, w, res)
    else:
        y = qmatmul(x, w, res) if isinstance(w, QuantWeight) else matmul(x, w, res)
    return y if lora is None else lora_apply(y, np.asarray(x, F32), lora)


# --- fused.cc row kernels -------------------------------------------------------------------------

def rmsnorm(x: np.ndarray, w: np.ndarray, eps) -> np.ndarray:
    """rmsnorm_row: 16-lane fma of squares, the tree, / C, + eps, sqrt, 1 /, then (x * r) * w."""
    x = np.asarray(x, F32)
    total = vec_dot(x, x)
    r = (_ONE / np.sqrt((total / F32(x.shape[-1]) + F32(eps)).astype(F32))).astype(F32)
    return ((x * r[..., None]).astype(F32) * w).astype(F32)


def swiglu(gu: np.ndarray) -> np.ndarray:
    """swiglu_row: e = exp(0 - |g|), sig = (g < 0 ? e : 1) / (1 + e), y = (g * sig) * u."""
    f = gu.shape[-1] // 2
    g, u = gu[..., :f].astype(F32), gu[..., f:].astype(F32)
    e = exp_nonpositive((F32(0) - np.abs(g)).astype(F32))
    sig = (np.where(g < 0, e, _ONE).astype(F32) / (_ONE + e).astype(F32)).astype(F32)
    return ((g * sig).astype(F32) * u).astype(F32)


def geglu(gu: np.ndarray) -> np.ndarray:
    """geglu_row: z = c2 (fma(c1, (g g) g, g)), e = exp(0 - |z|), sig = (z < 0 ? e : 1) / (1 + e), y = (g sig) u."""
    f = gu.shape[-1] // 2
    g, u = gu[..., :f].astype(F32), gu[..., f:].astype(F32)
    cube = ((g * g).astype(F32) * g).astype(F32)
    z = (F32(1.5957691216057308) * fma32(np.full_like(g, F32(0.044715)), cube, g)).astype(F32)
    e = exp_nonpositive((F32(0) - np.abs(z)).astype(F32))
    sig = (np.where(z < 0, e, _ONE).astype(F32) / (_ONE + e).astype(F32)).astype(F32)
    return ((g * sig).astype(F32) * u).astype(F32)


def norm_add(x: np.ndarray, w: np.ndarray, eps, res: np.ndarray) -> np.ndarray:
    """MindserveNormAdd: res + rmsnorm(x) w."""
    return (np.asarray(res, F32) + rmsnorm(x, w, eps)).astype(F32)


def rope_head(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """rope_head over the last axis D: lo, hi (+ bias); out_lo = fnmadd(hi, sin_lo, lo cos_lo),
    out_hi = fma(lo, sin_hi, hi cos_hi)."""
    x = np.asarray(x, F32)
    if bias is not None:
        x = (x + bias).astype(F32)
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    out_lo = fma32(-hi, sin[..., :half], (lo * cos[..., :half]).astype(F32))
    out_hi = fma32(lo, sin[..., half:], (hi * cos[..., half:]).astype(F32))
    return np.concatenate([out_lo, out_hi], -1)


# --- attention ------------------------------------------------------------------------------------

def attention(q, k, v, table, pos, rows, kv: int, bs: int, window: int = 0, scale=None) -> np.ndarray:
    """attention.cc attend() for q [N, H, D] over the paged caches k, v [KV S, D]: scores = dot * scale; masked
    max; e = exp(s - max); sum in vector order, the tree, 1 /; the fma chain of e_j v_j in key order; * inv. With
    ``window`` > 0 a query at position p reads keys (p - window, p] only, the first of them in lane 0 (the kernel
    indexes its scores from the window's first key); ``scale`` (float32) replaces 1 / sqrt(D)."""
    n_tok, heads, d = q.shape
    s_rows = k.shape[0] // kv
    nb = table.shape[1]
    end = np.clip(np.asarray(pos).reshape(-1).astype(np.int64) + 1, 1, nb * bs)  # [N]
    first = np.maximum(end - window, 0) if window > 0 else np.zeros_like(end)
    count = end - first
    length = int(count.max())
    j = np.arange(length)
    tok = np.repeat(np.arange(n_tok), heads)
    kvh = np.tile(np.arange(heads) // (heads // kv), n_tok)
    key = first[tok][:, None] + j[None, :]  # [Q, L] absolute key positions
    blocks = table[rows[tok][:, None], np.minimum(key // bs, nb - 1)]  # [Q, L]
    key_rows = kvh[:, None] * s_rows + blocks.astype(np.int64) * bs + key % bs
    valid = j[None, :] < count[tok][:, None]  # [Q, L]
    key_rows = np.where(valid, key_rows, 0)
    scale = (_ONE / np.sqrt(F32(d))).astype(F32) if scale is None else F32(scale)
    scores = (vec_dot(q.reshape(-1, 1, d), k[key_rows]) * scale).astype(F32)  # [Q, L]
    width = -(-length // LANES) * LANES
    padded = np.full((scores.shape[0], width), -np.inf, F32)
    padded[:, :length] = np.where(valid, scores, -np.inf)
    vmax = np.full((scores.shape[0], LANES), -np.inf, F32)
    for c in range(0, width, LANES):
        vmax = maxps(vmax, padded[:, c:c + LANES])
    mx = reduce_max16(vmax)
    e = np.where(valid, exp_nonpositive((scores - mx[:, None]).astype(F32)), F32(0)).astype(F32)
    inv = (_ONE / vec_sum(e)).astype(F32)
    acc = np.zeros((scores.shape[0], d), F32)
    values = v[key_rows]  # [Q, L, D]
    for i in range(length):
        acc = np.where(valid[:, i, None], fma32(e[:, i, None], values[:, i, :], acc), acc)
    return (acc * inv[:, None]).astype(F32).reshape(n_tok, heads * d)


@dataclass(frozen=True)
class Paged:
    """The cache side of QKVAttention: caches [KV S, D], write [N KV], table [R, NB], pos [N], rows [N]."""

    k: np.ndarray
    v: np.ndarray
    write: np.ndarray
    table: np.ndarray
    pos: np.ndarray
    rows: np.ndarray
    kv: int
    bs: int
    fmt: str = "float32"  # the caches' storage format (kv_ref.py); k and v are stored in it
    window: int = 0  # > 0: a sliding-window layer (attention's window)
    scale: float | None = None  # the score scale (float32), None: 1 / sqrt(D)


def qkv_rope(qkv, cos, sin, heads: int, kv: int, bias=None, qk_norm=None, eps=None):
    """The split and RoPE of MindserveQKVRope / QKVAttention: q [N, H, D], k [N, KV, D] roped, v [N, KV, D];
    with ``qk_norm`` [2, D] each q (row 0) and k (row 1) head RMS-normalised (rmsnorm_row over D) before RoPE."""
    d = cos.shape[-1]
    n = qkv.shape[0]
    x = np.asarray(qkv, F32) if bias is None else (qkv + bias.reshape(-1)).astype(F32)
    x = x.reshape(n, heads + 2 * kv, d)
    q, k = x[:, :heads], x[:, heads:heads + kv]
    if qk_norm is not None:
        q, k = rmsnorm(q, qk_norm[0], eps), rmsnorm(k, qk_norm[1], eps)
    c, s = cos[:, None, :], sin[:, None, :]
    return rope_head(q, c, s), rope_head(k, c, s), x[:, heads + kv:]


def qkv_attention(qkv, bias, cos, sin, cache: Paged, heads: int, qk_norm=None, eps=None):
    """MindserveQKVAttention: (+ bias,) (the q/k head norms,) rope, the K/V rows encoded in the caches' format into
    (copies of) them in token order (the last duplicate wins), then attention over the values they hold. Returns
    (out [N, H D], k cache, v cache)."""
    q, k_new, v_new = qkv_rope(qkv, cos, sin, heads, cache.kv, bias, qk_norm, eps)
    d = q.shape[-1]
    kc, vc = cache.k.copy(), cache.v.copy()
    k_rows, v_rows = (kv_ref.encode(x.reshape(-1, d), cache.fmt) for x in (k_new, v_new))
    for i, row in enumerate(cache.write.reshape(-1)):
        kc[row], vc[row] = k_rows[i], v_rows[i]
    out = attention(q, kv_ref.decode(kc, cache.fmt, d), kv_ref.decode(vc, cache.fmt, d), cache.table, cache.pos,
                    cache.rows, cache.kv, cache.bs, cache.window, cache.scale)
    return out, kc, vc


# --- composite entries ----------------------------------------------------------------------------

def norm_matmul(x, w_norm, eps, w, lora: Lora | None = None) -> np.ndarray:
    return product(rmsnorm(x, w_norm, eps), w, None, lora)


def swiglu_matmul_add(gu, w, res, lora: Lora | None = None) -> np.ndarray:
    return product(swiglu(gu), w, res, lora)


def decoder_layer(x, attn_norm, eps, wqkv, bias, cos, sin, cache: Paged, heads: int, wo, ffn_norm, w_gate_up,
                  w_down, qk_norm=None, qk_eps=None):
    """MindserveDecoderLayer's five stages in order. Returns (y [N, C], k cache, v cache)."""
    qkv = norm_matmul(x, attn_norm, eps, wqkv)
    a, kc, vc = qkv_attention(qkv, bias, cos, sin, cache, heads, qk_norm, qk_eps)
    h = product(a, wo, x)
    y = swiglu_matmul_add(norm_matmul(h, ffn_norm, eps, w_gate_up), w_down, h)
    return y, kc, vc


def embed_rope(ids, pos, embed, cos_t, sin_t):
    ids, pos = np.asarray(ids).reshape(-1), np.asarray(pos).reshape(-1)
    return embed[ids], cos_t[pos], sin_t[pos]


def norm_head(x, w_norm, eps, last, w):
    """MindserveNormHead: (logits = the product of hidden[last], hidden = rmsnorm(x))."""
    hidden = rmsnorm(x, w_norm, eps)
    return product(hidden[np.asarray(last)], w), hidden


# --- moe.cc ---------------------------------------------------------------------------------------

def route(logits: np.ndarray, top_k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """moe.cc route() per row: m the max, e = exp_nonpositive(l - m), p = e / (the 16-lane sum); the top_k
    experts by p (ties: the lower index) in rank order, their weights p, or p / (p_0 + p_1 + ...) in rank order.
    Returns (sel [N, k] int, weight [N, k] float32)."""
    logits = np.asarray(logits, F32)
    m = logits.max(axis=-1, keepdims=True)
    e = exp_nonpositive((logits - m).astype(F32))
    p = (e / vec_sum(e)[..., None]).astype(F32)
    sel = np.zeros((logits.shape[0], top_k), np.int64)
    weight = np.zeros((logits.shape[0], top_k), F32)
    for r in range(logits.shape[0]):
        order = sorted(range(p.shape[1]), key=lambda i: (-float(p[r, i]), i))[:top_k]
        sel[r], weight[r] = order, p[r, order]
        if norm:
            total = weight[r, 0]
            for j in range(1, top_k):
                total = F32(total + weight[r, j])
            weight[r] = (weight[r] / total).astype(F32)
    return sel, weight


def moe(h, ffn_norm, eps, router, w_gate_up: list, w_down: list, top_k: int, norm: bool) -> np.ndarray:
    """MindserveMoE: x = rmsnorm(h), the route of x @ router, each chosen expert's swiglu MLP on the row, then
    y = h + acc with acc = 0, acc = acc + w * d over the row's experts in index order. ``w_gate_up[e]`` /
    ``w_down[e]``: expert e's weights as ``product`` takes them."""
    h = np.asarray(h, F32)
    x = rmsnorm(h, ffn_norm, eps)
    sel, weight = route(product(x, router), top_k, norm)
    y = np.empty_like(h)
    for r in range(h.shape[0]):
        acc = np.zeros(h.shape[1], F32)
        for j in np.argsort(sel[r], kind="stable"):
            e = sel[r, j]
            d = product(swiglu(product(x[r:r + 1], w_gate_up[e])), w_down[e])[0]
            acc = (acc + (d * weight[r, j]).astype(F32)).astype(F32)
        y[r] = (h[r] + acc).astype(F32)
    return y


def moe_decoder_layer(x, attn_norm, eps, wqkv, bias, cos, sin, cache: Paged, heads: int, wo, ffn_norm, router,
                      w_gate_up: list, w_down: list, top_k: int, norm: bool, qk_norm=None, qk_eps=None):
    """MindserveMoEDecoderLayer: the decoder layer's attention half, then ``moe``. Returns (y, k cache, v cache)."""
    qkv = norm_matmul(x, attn_norm, eps, wqkv)
    a, kc, vc = qkv_attention(qkv, bias, cos, sin, cache, heads, qk_norm, qk_eps)
    h = product(a, wo, x)
    return moe(h, ffn_norm, eps, router, w_gate_up, w_down, top_k, norm), kc, vc


def gemma_decoder_layer(x, attn_norm, eps, wqkv, bias, cos, sin, cache: Paged, heads: int, wo, post_attn_norm,
                        ffn_norm, w_gate_up, w_down, post_ffn_norm, qk_norm, qk_eps):
    """MindserveGemmaDecoderLayer's seven stages in order (the cache's window and scale from meta). Returns
    (y [N, C], k cache, v cache)."""
    qkv = norm_matmul(x, attn_norm, eps, wqkv)
    a, kc, vc = qkv_attention(qkv, bias, cos, sin, cache, heads, qk_norm, qk_eps)
    h = norm_add(product(a, wo), post_attn_norm, eps, x)
    m = product(geglu(norm_matmul(h, ffn_norm, eps, w_gate_up)), w_down)
    return norm_add(m, post_ffn_norm, eps, h), kc, vc
