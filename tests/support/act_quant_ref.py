"""The AOT quantized matmuls' activation quantization (quantize.h) for the float64 references of
the network tests; tests/support/kernel_ref.py has its float32-exact twin for the kernel tests.

32-block formats, per row and block of 32: q = round_half_even(x * 127 / amax), dx = fp16(amax / 127) and
sfx = fp16(amax / 127 * sum q), as llama.cpp's block_q8_0.d / block_q8_1.s hold them. A block's product is
d_w dx sum(q_w q) (+ m_w sfx for Q4_1 / Q5_1, whose weights are d_w q_w + m_w), that is (dx q) @ w plus, for the
formats with a min, m_w (sfx - dx sum q): the second term is why a dequantized weight alone does not say it all.
K-quants (Q8_K), per 256: dx = 1 / (127 / amax), kept in float32 by llama.cpp and the kernel alike.
"""
from __future__ import annotations

import numpy as np

_MIN_FORMATS = {"q4_1": 20, "q5_1": 24}  # block bytes; the min m is the fp16 at bytes 2..3 of each block


def _fp16(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return v.astype(np.float16).astype(v.dtype)


def _blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(q, the unrounded dx: amax / 127, or 1 / (127 / amax) for 256) per block: [..., nb, block], [..., nb, 1]."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax > 0, np.rint(xb * (127.0 / amax)), 0.0)
        d = amax / 127.0 if block == 32 else np.where(amax > 0, 1.0 / (127.0 / amax), 0.0)
    return q, d


def quant_dequant(x: np.ndarray, block: int = 32) -> np.ndarray:
    """The matmul's input as the kernel sees it: dx * q per block (dx rounded to fp16 for blocks of 32)."""
    q, d = _blocks(x, block)
    return (q * (_fp16(d) if block == 32 else d)).reshape(x.shape)


def block_mins(fmt: str, blocks: np.ndarray) -> np.ndarray | None:
    """The m of each block of a Q4_1 / Q5_1 tensor [N, nb] (float64) from its GGUF bytes [N, nb * B]; None for the
    formats without a min."""
    size = _MIN_FORMATS.get(fmt)
    if size is None:
        return None
    b = np.ascontiguousarray(blocks, np.uint8).reshape(blocks.shape[0], -1, size)
    return np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float64)


def mins_term(x: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """What the kernel adds to (dx q) @ w for a weight with block mins [N, nb]: sum_b m_b (sfx_b - dx_b sum q_b)."""
    q, d = _blocks(x, 32)
    s = q.sum(-1, keepdims=True)
    delta = (_fp16(d * s) - _fp16(d) * s)[..., 0]  # [..., nb]
    return delta @ mins.T


def linear(x: np.ndarray, w: np.ndarray, block: int = 32, mins: np.ndarray | None = None) -> np.ndarray:
    """x @ w.T as the quantized kernel computes it (w the dequantized [N, K] weight)."""
    y = quant_dequant(x, block) @ w.T
    return y if mins is None else y + mins_term(x, mins)
