"""GGUF block-quantized weights as the loader hands them to the network: ``QuantWeight`` (raw GGUF blocks of
one matrix), its dequantization (the stock-op path and the embedding do it once at load), stacking and
row permutation.

Formats (GGUF's own layouts, 32 weights per block, a row of K weights is K/32 blocks back to back):
``q8_0`` (fp16 d, 32 int8: w = d*q, 34 bytes), ``q4_0`` (fp16 d, 16 nibble bytes: w = d*(q - 8), 18 bytes),
``q4_1`` (fp16 d, fp16 m, 16 nibble bytes: w = d*q + m, 20 bytes); nibble byte i holds weight i (low half)
and weight i + 16 (high half).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
QUANT_KEY = "mindserve.quantization"  # safetensors metadata of a quantized conversion: JSON {tensor name: format}
FORMATS = tuple(BLOCK_BYTES)


class QuantError(ValueError):
    pass


@dataclass(frozen=True)
class QuantWeight:
    """A [rows, cols] matrix (HF layout: rows = outputs) as GGUF blocks: ``blocks`` uint8 [rows, cols/32 * B]."""

    fmt: str
    rows: int
    cols: int
    blocks: np.ndarray

    def __post_init__(self) -> None:
        if self.fmt not in BLOCK_BYTES:
            raise QuantError(f"unknown quantization format {self.fmt!r}; use one of {FORMATS}")
        if self.cols % BLOCK:
            raise QuantError(f"{self.fmt} needs a row length divisible by {BLOCK}, got {self.cols}")
        want = (self.rows, self.cols // BLOCK * BLOCK_BYTES[self.fmt])
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


def dequantize(q: QuantWeight) -> np.ndarray:
    """float32 [rows, cols]."""
    b = q.blocks.reshape(q.rows, q.cols // BLOCK, BLOCK_BYTES[q.fmt])
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    if q.fmt == "q8_0":
        w = d * b[..., 2:].view(np.int8).astype(np.float32)
    else:
        qs = b[..., 4:] if q.fmt == "q4_1" else b[..., 2:]
        nib = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # weights 0..15, 16..31
        if q.fmt == "q4_0":
            w = d * (nib - 8.0)
        else:
            w = d * nib + b[..., 2:4].copy().view(np.float16).astype(np.float32)
    return np.ascontiguousarray(w.reshape(q.rows, q.cols), dtype=np.float32)


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


def permute_rows(q: QuantWeight, order: np.ndarray) -> QuantWeight:
    """The same matrix with its rows reordered (whole rows of blocks)."""
    return QuantWeight(q.fmt, q.rows, q.cols, np.ascontiguousarray(q.blocks[order]))
