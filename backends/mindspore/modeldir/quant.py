"""GGUF block-quantized weights as the loader hands them to the network: ``QuantWeight`` (raw GGUF blocks of
one matrix), its dequantization (the stock-op path and the embedding do it once at load), stacking
(``stack_segments``: parts in different formats as runs of one format each) and row permutation, and ``unpack``
(every format as unsigned quants plus its scales: what the kernels' packing and the NumPy reference read).

Formats (GGUF's own layouts; a row of K weights is K/B blocks back to back, B = ``BLOCK_SIZE[fmt]``):
32-weight blocks: ``q8_0`` (fp16 d, 32 int8: w = d*q, 34 bytes), ``q4_0`` (fp16 d, 16 nibble bytes:
w = d*(q - 8), 18 bytes), ``q4_1`` (fp16 d, fp16 m, 16 nibble bytes: w = d*q + m, 20 bytes), ``q5_0`` (fp16 d,
uint32 qh of fifth bits, 16 nibble bytes: w = d*(q - 16), 22 bytes), ``q5_1`` (fp16 d, fp16 m, qh, nibbles:
w = d*q + m, 24 bytes); nibble byte i holds weight i (low half) and weight i + 16 (high half), bit i of qh is
weight i's fifth bit.
256-weight super-blocks (K-quants): ``q4_k`` (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins of 8
sub-blocks of 32, 128 nibble bytes: w = (d*sc_j)*q - dmin*m_j, 144 bytes), ``q5_k`` (the same plus 32 bytes of
fifth bits, q 0..31, 176 bytes), ``q6_k`` (128 bytes of low nibbles, 64 of two high bits, 16 int8 scales of
sub-blocks of 16, fp16 d: w = (d*sc_j)*(q - 32), 210 bytes), as ggml-common.h lays them out.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 32  # the 32-weight blocks, and the sub-blocks of a K-quant super-block
SUPER = 256  # a K-quant super-block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176, "q6_k": 210}
BLOCK_SIZE = {f: SUPER if f.endswith("_k") else BLOCK for f in BLOCK_BYTES}  # weights per block
QUANT_KEY = "mindserve.quantization"  # safetensors metadata of a quantized conversion: JSON {tensor name: format}
FORMATS = tuple(BLOCK_BYTES)


def embedding_in_head(tied: bool, fmt: str | None) -> bool:
    """Whether the AOT networks read the embedding's rows from the packed LM head (``network/embedding.py``, the
    kernel dequantizes Q8_0 rows as it gathers them) rather than from a float32 table: a tied Q8_0 embedding. The
    memory budget asks it too (``planning/memory.py``: no float32 table is held then)."""
    return tied and fmt == "q8_0"


class QuantError(ValueError):
    pass


@dataclass(frozen=True)
class QuantWeight:
    """A [rows, cols] matrix (HF layout: rows = outputs) as GGUF blocks: ``blocks`` uint8 [rows, cols/B * bytes]."""

    fmt: str
    rows: int
    cols: int
    blocks: np.ndarray

    def __post_init__(self) -> None:
        if self.fmt not in BLOCK_BYTES:
            raise QuantError(f"unknown quantization format {self.fmt!r}; use one of {FORMATS}")
        if self.cols % BLOCK_SIZE[self.fmt]:
            raise QuantError(f"{self.fmt} needs a row length divisible by {BLOCK_SIZE[self.fmt]}, got {self.cols}")
        want = (self.rows, self.cols // BLOCK_SIZE[self.fmt] * BLOCK_BYTES[self.fmt])
        if self.blocks.dtype != np.uint8 or self.blocks.shape != want:
            raise QuantError(f"{self.fmt} blocks of a [{self.rows}, {self.cols}] matrix must be uint8 {want}, "
                             f"got {self.blocks.dtype} {self.blocks.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def dequantize(self) -> np.ndarray:
        return dequantize(self)


def cols_of(fmt: str, row_bytes: int) -> int:
    """The row length of GGUF rows of ``row_bytes`` bytes in ``fmt``."""
    return row_bytes // BLOCK_BYTES[fmt] * BLOCK_SIZE[fmt]


def _half(b: np.ndarray, lo: int) -> np.ndarray:
    return b[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)


@dataclass(frozen=True)
class Unpacked:
    """A matrix's GGUF blocks as numbers: ``u`` the unsigned quants [N, K] (int64; q8_0: q + 128), ``d`` the
    per-block fp16 scale [N, K/B] as float32, ``m`` the second fp16 (q4_1/q5_1 m, q4_k/q5_k dmin) or None,
    ``sc`` / ``mn`` the K-quants' integer sub-block scales / mins [N, K/256, 8 or 16] (q6_k: 16 int8 scales,
    no mins) or None, ``offset`` what the format subtracts from u (q8_0 128, q4_0 8, q5_0 16, q6_k 32, else 0)."""

    u: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    sc: np.ndarray | None
    mn: np.ndarray | None
    offset: int


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of q4_k / q5_k [.., 12] -> 6-bit scales, mins [.., 8] (ggml get_scale_min_k4)."""
    s = s.astype(np.int64)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], -1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], -1)
    return sc, mn


def unpack(q: QuantWeight) -> Unpacked:
    fmt, n = q.fmt, q.rows
    b = q.blocks.reshape(n, -1, BLOCK_BYTES[fmt])
    nb = b.shape[1]
    if fmt == "q8_0":
        return Unpacked(b[..., 2:].view(np.int8).astype(np.int64).reshape(n, -1) + 128, _half(b, 0), None, None,
                        None, 128)
    if fmt in ("q4_0", "q4_1", "q5_0", "q5_1"):
        lo = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[fmt]
        qs = b[..., lo:].astype(np.int64)
        u = np.concatenate([qs & 15, qs >> 4], -1)  # [N, nb, 32]
        if fmt.startswith("q5"):
            qh = b[..., lo - 4:lo].copy().view(np.uint32).astype(np.int64)  # [N, nb, 1]
            u = u | (((qh >> np.arange(32)) & 1) << 4)
        m = _half(b, 2) if fmt.endswith("_1") else None
        return Unpacked(u.reshape(n, -1), _half(b, 0), m, None, None, {"q4_0": 8, "q5_0": 16}.get(fmt, 0))
    if fmt in ("q4_k", "q5_k"):
        sc, mn = _k4_scales(b[..., 4:16])
        qs = b[..., -128:].astype(np.int64).reshape(n, nb, 4, 32)
        u = np.stack([qs & 15, qs >> 4], 3)  # [N, nb, 4 chunks of 64, 2 halves, 32]: sub-block 2c + h
        if fmt == "q5_k":
            qh = b[..., 16:48].astype(np.int64)  # bit s of qh[l]: sub-block s, weight l
            hb = (qh[:, :, None, :] >> np.arange(8)[:, None]) & 1  # [N, nb, 8, 32]
            u = u | (hb.reshape(n, nb, 4, 2, 32) << 4)
        return Unpacked(u.reshape(n, -1), _half(b, 0), _half(b, 2), sc, mn, 0)
    assert fmt == "q6_k"
    ql = b[..., 0:128].astype(np.int64).reshape(n, nb, 2, 2, 32)  # [half, 32-byte row, l]
    qh = b[..., 128:192].astype(np.int64).reshape(n, nb, 2, 1, 32)
    low = np.stack([ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], 3)
    high = (qh >> (2 * np.arange(4))[:, None]) & 3  # [N, nb, 2, 4, 32]
    u = low | (high << 4)
    sc = b[..., 192:208].view(np.int8).astype(np.int64)
    return Unpacked(u.reshape(n, -1), _half(b, 208), None, sc, None, 32)


def dequantize(q: QuantWeight) -> np.ndarray:
    """float32 [rows, cols], in ggml's (and the gguf package's) float32 operation order."""
    p = unpack(q)
    n, f32 = q.rows, np.float32
    if q.fmt in ("q8_0", "q4_0", "q5_0", "q4_1", "q5_1"):
        v = (p.u - p.offset).reshape(n, -1, BLOCK).astype(f32)
        w = p.d[..., None] * v
        if p.m is not None:
            w = w + p.m[..., None]
    elif q.fmt in ("q4_k", "q5_k"):
        ds = (p.d[..., None] * p.sc.astype(f32)).astype(f32)  # [N, nb, 8]
        dm = (p.m[..., None] * p.mn.astype(f32)).astype(f32)
        w = ds[..., None] * p.u.reshape(n, -1, 8, 32).astype(f32) - dm[..., None]
    else:
        ds = (p.d[..., None] * p.sc.astype(f32)).astype(f32)  # [N, nb, 16]
        w = ds[..., None] * (p.u - 32).reshape(n, -1, 16, 16).astype(f32)
    return np.ascontiguousarray(w.reshape(n, q.cols), dtype=f32)


# --- quantizers (tests write K-quant GGUFs with them) -----------------------------------------------------

def _nearest(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int64)


def _pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of _k4_scales: 6-bit scales, mins [.., 8] -> 12 bytes."""
    out = np.empty(sc.shape[:-1] + (12,), np.int64)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out.astype(np.uint8)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float16)[..., None].view(np.uint8)


def quantize(w: np.ndarray, fmt: str) -> QuantWeight:
    """A float [rows, cols] matrix as ``fmt`` blocks. The 32-block formats by the gguf package (llama.cpp's
    reference quantizers); the K-quants by a plain round-to-nearest of this module (ggml's search for the
    scales is not reproduced: good to a few percent of the weights' range, enough for tests and for the parts
    of a mixed stack)."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    if fmt not in BLOCK_BYTES:
        raise QuantError(f"unknown quantization format {fmt!r}; use one of {FORMATS}")
    if cols % BLOCK_SIZE[fmt]:
        raise QuantError(f"{fmt} needs a row length divisible by {BLOCK_SIZE[fmt]}, got {cols}")
    if not fmt.endswith("_k"):
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as gguf_quantize

        blocks = gguf_quantize(w, GGMLQuantizationType[fmt.upper()])
        return QuantWeight(fmt, rows, cols, np.ascontiguousarray(blocks.reshape(rows, -1)))
    nb = cols // SUPER
    x = w.reshape(rows, nb, -1)
    if fmt == "q6_k":
        sub = x.reshape(rows, nb, 16, 16)
        s = np.abs(sub).max(-1) / 31.0  # sub-block scales, symmetric
        d = (s.max(-1) / 127.0).astype(np.float16).astype(np.float32)  # [N, nb]
        with np.errstate(all="ignore"):
            sc = np.clip(_nearest(np.where(d[..., None] > 0, s / d[..., None], 0)), -128, 127)
            step = (d[..., None] * sc.astype(np.float32))[..., None]
            q = np.clip(_nearest(np.where(step != 0, sub / step, 0)), -32, 31) + 32  # [N, nb, 16, 16]
        q = q.reshape(rows, nb, 2, 4, 32)  # [half, group of 32, l]
        ql = np.concatenate([(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4),
                             (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)], -1)  # [N, nb, 2, 64]
        qh = sum((q[:, :, :, g] >> 4) << (2 * g) for g in range(4))  # [N, nb, 2, 32]
        blocks = np.concatenate([ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64),
                                 sc.astype(np.int8).view(np.uint8).reshape(rows, nb, 16),
                                 _f16_bytes(d).reshape(rows, nb, 2)], -1)
        return QuantWeight(fmt, rows, cols, np.ascontiguousarray(blocks.astype(np.uint8).reshape(rows, -1)))
    top = 15 if fmt == "q4_k" else 31
    sub = x.reshape(rows, nb, 8, 32)
    mn = np.maximum(0.0, -sub.min(-1))  # [N, nb, 8]
    scale = (sub.max(-1) + mn) / top
    d = (scale.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (mn.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        sc = np.clip(_nearest(np.where(d[..., None] > 0, scale / d[..., None], 0)), 0, 63)
        mi = np.clip(_nearest(np.where(dmin[..., None] > 0, mn / dmin[..., None], 0)), 0, 63)
        step = (d[..., None] * sc)[..., None]
        q = np.clip(_nearest(np.where(step > 0, (sub + (dmin[..., None] * mi)[..., None]) / step, 0)), 0, top)
    q = q.reshape(rows, nb, 4, 2, 32)  # chunk c of 64: sub-blocks 2c (low nibbles), 2c + 1 (high nibbles)
    qs = ((q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)).reshape(rows, nb, 128)
    parts = [_f16_bytes(d).reshape(rows, nb, 2), _f16_bytes(dmin).reshape(rows, nb, 2), _pack_k4_scales(sc, mi)]
    if fmt == "q5_k":
        hb = (q.reshape(rows, nb, 8, 32) >> 4) & 1
        parts.append(sum(hb[:, :, s] << s for s in range(8)))  # [N, nb, 32]
    blocks = np.concatenate([p.astype(np.int64) for p in parts] + [qs], -1).astype(np.uint8)
    return QuantWeight(fmt, rows, cols, np.ascontiguousarray(blocks.reshape(rows, -1)))


def layers_format(formats: Mapping[str, str]) -> str:
    """{tensor name: storage format} -> what the layers' matrices are: the one format (``float32`` included)
    they all share, or ``mixed`` (the predict yaml's ``model_config.weight_dtype``)."""
    found = {f for name, f in formats.items() if name.startswith("model.layers.") and name.endswith("_proj.weight")}
    return found.pop() if len(found) == 1 else ("mixed" if found else "float32")


def concat_rows(parts: Sequence[QuantWeight]) -> QuantWeight:
    """Stack matrices of one format along their rows (q, k, v into one qkv)."""
    fmts, cols = {p.fmt for p in parts}, {p.cols for p in parts}
    if len(fmts) != 1 or len(cols) != 1:
        raise QuantError(f"cannot stack {sorted(fmts)} matrices of widths {sorted(cols)}")
    return QuantWeight(parts[0].fmt, sum(p.rows for p in parts), parts[0].cols,
                       np.concatenate([p.blocks for p in parts], axis=0))


def stack_segments(parts: Sequence[QuantWeight]) -> list[QuantWeight]:
    """Parts stacked along their rows (q, k, v into one qkv) that may ship in different formats, as runs of one
    format each, in order: neighbours of one format are one run (``concat_rows``), so a uniform stack is one
    matrix. No byte changes: the kernels multiply each run in its own format (qmatmul.cc's segmented weights).
    (Q5_0 q/k beside a Q8_0 v, llama-quantize's fallback for rows that are not whole super-blocks, were once
    rewritten as Q8_0 blocks of the same values, exactly; as segments they are 28% fewer bytes and, at one row,
    faster: docs/performance.md.)"""
    if len({p.cols for p in parts}) != 1:
        raise QuantError(f"cannot stack matrices of widths {sorted({p.cols for p in parts})}")
    runs: list[list[QuantWeight]] = []
    for p in parts:
        if runs and runs[-1][0].fmt == p.fmt:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [run[0] if len(run) == 1 else concat_rows(run) for run in runs]


def permute_rows(q: QuantWeight, order: np.ndarray) -> QuantWeight:
    """The same matrix with its rows reordered (whole rows of blocks)."""
    return QuantWeight(q.fmt, q.rows, q.cols, np.ascontiguousarray(q.blocks[order]))
