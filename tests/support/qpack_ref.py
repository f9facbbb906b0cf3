"""NumPy reference of the quantized weights' packing (qformat.h; the library packs with pack.cc's
MindservePackQWeight): the GGUF blocks of a ``QuantWeight`` read through ``quant.unpack`` and rearranged with array
operations, so the kernel's byte shuffling is checked against an independent writing of the same layout."""
from __future__ import annotations

import numpy as np

from backends.mindspore.kernels import kernel_constants
from backends.mindspore.modeldir.quant import BLOCK, BLOCK_BYTES, BLOCK_SIZE, QuantWeight, unpack

# Byte offsets of each format's fp16 fields in its GGUF block (quant.py's docstring).
HALF_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
               "q5_k": (0, 2), "q6_k": (208,)}


def random_blocks(fmt: str, n: int, blocks: int, rng: np.random.Generator, finite: bool = True) -> QuantWeight:
    """``n`` rows of ``blocks`` random GGUF blocks (any byte pattern); with ``finite`` the fp16 fields are kept below
    2 in magnitude (no infinity or NaN, subnormals included), as a converter writes them."""
    b = rng.integers(0, 256, (n, blocks, BLOCK_BYTES[fmt]), dtype=np.uint8)
    if finite:
        for lo in HALF_FIELDS[fmt]:
            b[..., lo + 1] &= 0xBF  # the exponent's top bit clear
    return QuantWeight(fmt, n, blocks * BLOCK_SIZE[fmt], np.ascontiguousarray(b.reshape(n, -1)))


def pack_qweight(q: QuantWeight) -> np.ndarray:
    """uint8 ``[1, K/B * P, N]``: groups of 16 output columns, each holding, block after block, the quants of its
    columns dword-major (one 64-byte load = one dword of each of 16 columns; q8_0 quants stored + 128) and then
    their scales."""
    if q.fmt not in ("q8_0", "q4_0", "q4_1"):
        return _pack_q5k(q)
    n, k, bpb = q.rows, q.cols, BLOCK_BYTES[q.fmt]
    nb = k // BLOCK
    b = q.blocks.reshape(n, nb, bpb)
    scales = b[..., :4] if q.fmt == "q4_1" else b[..., :2]  # d (and m), fp16 bytes
    quants = b[..., scales.shape[-1]:]
    if q.fmt == "q8_0":
        quants = quants ^ np.uint8(0x80)  # int8 q -> q + 128, unsigned for the u8 x s8 dot product
    dwords = quants.reshape(n, nb, -1, 4)  # [N, nb, D, 4]
    halves = scales.reshape(n, nb, -1, 2)  # [N, nb, 1 or 2, 2]: d, m
    return _groups(dwords, halves, bpb)


def _pack_q5k(q: QuantWeight) -> np.ndarray:
    """q5_0, q5_1 and the K-quants: per block of the format, for each sub-block of 32 the low nibbles as q4's dwords
    and the high bits as 1 (5-bit) or 2 (q6_k) more dwords per column, then the K-quants' integer sub-block scales
    (4 dwords per column), then the fp16 d and the second fp16."""
    n, k, fmt = q.rows, q.cols, q.fmt
    p = unpack(q)
    nb = k // BLOCK_SIZE[fmt]
    sub = p.u.reshape(n, nb, -1, 2, 4, 4)  # [N, nb, SB, half (weights 0..15 | 16..31), t, i]: weight 16h + 4t + i
    nib = (sub[:, :, :, 0] & 15) | ((sub[:, :, :, 1] & 15) << 4)  # [N, nb, SB, t, i]
    planes = [nib]
    if fmt == "q6_k":
        hi = sub >> 4  # 0..3
        planes.append(sum(hi[:, :, :, :, t] << (2 * t) for t in range(4)))  # dword h, byte i: bits 2t, 2t + 1
        # hold weight 16h + 4t + i's high bits
    elif fmt != "q4_k":
        hi = (sub >> 4) & 1
        planes.append((sum(hi[:, :, :, 0, t] << t for t in range(4)) |
                       sum(hi[:, :, :, 1, t] << (4 + t) for t in range(4)))[:, :, :, None, :])  # one dword
    quants = np.concatenate(planes, 3).astype(np.uint8)  # [N, nb, SB, D, 4]
    per_block = [quants.reshape(n, nb, -1, 4)]  # dwords, in the order the kernel reads them
    if fmt in ("q4_k", "q5_k"):
        per_block.append(np.concatenate([p.sc, p.mn], -1).astype(np.uint8).reshape(n, nb, 4, 4))
    elif fmt == "q6_k":
        per_block.append(p.sc.astype(np.int8).view(np.uint8).reshape(n, nb, 4, 4))
    halves = [p.d] + ([p.m] if p.m is not None else [])
    half = np.stack(halves, -1).astype(np.float16).view(np.uint8).reshape(n, nb, len(halves), 2)
    dwords = np.concatenate(per_block, 2)  # [N, nb, D, 4]
    packed_bytes = kernel_constants().packed_bytes[fmt]
    assert dwords.shape[2] * 4 + half.shape[2] * 2 == packed_bytes
    return _groups(dwords, half, packed_bytes)


def _groups(dwords: np.ndarray, halves: np.ndarray, pb: int) -> np.ndarray:
    """Per group of 16 columns (the last may be narrower), block after block: the dwords [D][w], then the halves."""
    n, nb = dwords.shape[:2]
    out = np.empty(n * nb * pb, np.uint8)
    pos = 0
    width = kernel_constants().qgroup
    for n0 in range(0, n, width):
        w = min(width, n - n0)
        qd = dwords[n0:n0 + w].transpose(1, 2, 0, 3).reshape(nb, -1)  # [nb, D * w * 4]
        sc = halves[n0:n0 + w].transpose(1, 2, 0, 3).reshape(nb, -1)  # [nb, (1|2) * w * 2]
        group = np.concatenate([qd, sc], axis=1).ravel()
        out[pos:pos + group.size] = group
        pos += group.size
    return out.reshape(1, nb * pb, n)
