"""NumPy reference of the KV cache's storage formats (kernels/kv_format.h), written from the formats' definitions:
float16 by NumPy's own IEEE conversion, bfloat16 as float32's upper half rounded to nearest even, q8_0 as
llama.cpp's block_q8_0 (an fp16 scale d = amax / 127, then 32 int8 round-half-even(x / d)).

A stored cache is what the kernel's tensor holds: float32 / float16 [rows, D], bfloat16 as uint16 [rows, D] (NumPy
has no bfloat16; ``kernel_entries`` passes a uint16 array to the kernels as "bfloat16"), q8_0 as uint8
[rows, ceil(D / 32) * 34].
"""
from __future__ import annotations

import numpy as np

F32 = np.float32
FORMATS = ("float32", "float16", "bfloat16", "q8_0")
CODES = {name: i for i, name in enumerate(FORMATS)}  # kv_format.h's kv::Format
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34


def encode(x: np.ndarray, fmt: str) -> np.ndarray:
    """Rows x [..., D] float32 in ``fmt``'s storage."""
    x = np.asarray(x, F32)
    if fmt == "float32":
        return x.copy()
    if fmt == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    if fmt == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        nan = np.isnan(x)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)
    if fmt == "q8_0":
        return _encode_q8_0(x)
    raise ValueError(fmt)


def _encode_q8_0(x: np.ndarray) -> np.ndarray:
    d = x.shape[-1]
    nb = -(-d // Q8_BLOCK)
    padded = np.zeros((*x.shape[:-1], nb * Q8_BLOCK), F32)
    padded[..., :d] = x
    blocks = padded.reshape(*x.shape[:-1], nb, Q8_BLOCK)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    scale = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale != 0, np.clip(np.rint((blocks / scale).astype(F32)), -127, 127), 0).astype(np.int8)
    out = np.zeros((*x.shape[:-1], nb, Q8_BLOCK_BYTES), np.uint8)
    with np.errstate(over="ignore"):  # a scale past float16's range is stored as infinity, as the kernel does
        out[..., :2] = scale.astype("<f2").view(np.uint8).reshape(*x.shape[:-1], nb, 2)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(*x.shape[:-1], nb * Q8_BLOCK_BYTES)


def decode(stored: np.ndarray, fmt: str, d: int) -> np.ndarray:
    """The float32 values [..., D] a stored cache holds: exact widenings, float(q) * float(scale) for q8_0."""
    if fmt == "float32":
        return np.asarray(stored, F32)
    if fmt == "float16":
        return stored.astype(F32)
    if fmt == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(F32)
    if fmt == "q8_0":
        nb = -(-d // Q8_BLOCK)
        blocks = stored.reshape(*stored.shape[:-1], nb, Q8_BLOCK_BYTES)
        scale = np.ascontiguousarray(blocks[..., :2]).view("<f2").astype(F32)  # [..., nb, 1]
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(F32)
        return (q * scale).astype(F32).reshape(*stored.shape[:-1], nb * Q8_BLOCK)[..., :d]
    raise ValueError(fmt)


def zeros(rows: int, d: int, fmt: str) -> np.ndarray:
    """An empty cache of ``rows`` rows in ``fmt``'s storage."""
    return encode(np.zeros((rows, d), F32), fmt)
