"""quant.py's block formats against the `gguf` package (an independent reader of GGUF's layouts): dequantization of
quantized and of random-byte blocks of every format, bit for bit; the K-quant quantizer's blocks within a step of
the weights; stacks of mixed formats (quant.stack_segments: runs of one format, every weight as shipped)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from backends.mindspore.modeldir.quant import (BLOCK_BYTES, BLOCK_SIZE, FORMATS, QuantError, QuantWeight, dequantize,
                                               quantize, stack_segments)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_the_gguf_package(fmt):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((7, 512)) * 0.1).astype(np.float32)
    w[:, :32] += 0.05
    q = quantize(w, fmt)
    np.testing.assert_array_equal(dequantize(q), gguf_dequantize(q.blocks, T[fmt.upper()]).reshape(7, 512))
    raw = rng.integers(0, 256, (5, 512 // BLOCK_SIZE[fmt] * BLOCK_BYTES[fmt]), dtype=np.uint8)
    with np.errstate(all="ignore"):  # random fp16 scales include infinities and NaNs: both sides the same
        np.testing.assert_array_equal(dequantize(QuantWeight(fmt, 5, 512, raw)),
                                      gguf_dequantize(raw, T[fmt.upper()]).reshape(5, 512))


@pytest.mark.parametrize("fmt,bound", [("q4_k", 0.07), ("q5_k", 0.035), ("q6_k", 0.02)])
def test_the_k_quant_quantizer_is_within_a_step(fmt, bound):
    """Round-to-nearest with 6-bit (8-bit for Q6_K) sub-block scales: the error stays within a fraction of the
    weights' range (measured 0.046, 0.024, 0.015 of max |w|)."""
    w = (np.random.default_rng(2).standard_normal((16, 768)) * 0.1).astype(np.float32)
    err = np.abs(quantize(w, fmt).dequantize() - w).max()
    assert 0 < err <= bound * np.abs(w).max()


def test_a_k_quant_needs_whole_super_blocks():
    with pytest.raises(QuantError, match="q4_k needs a row length divisible by 256, got 576"):
        quantize(np.zeros((2, 576), np.float32), "q4_k")
    with pytest.raises(QuantError, match="q6_k blocks of a \\[2, 256\\] matrix must be uint8 \\(2, 210\\)"):
        QuantWeight("q6_k", 2, 256, np.zeros((2, 144), np.uint8))


def test_a_stack_of_mixed_formats_keeps_every_part_as_shipped():
    """Q4_K_M's q, k in Q4_K beside a Q6_K v: two runs, q and k one Q4_K matrix, v its own; no bytes change."""
    rng = np.random.default_rng(0)
    q, k, v, u = (quantize((rng.standard_normal((r, 256)) * 0.1).astype(np.float32), f)
                  for r, f in [(64, "q4_k"), (32, "q4_k"), (32, "q6_k"), (16, "q4_k")])
    runs = stack_segments([q, k, v, u])
    assert [(r.fmt, r.rows) for r in runs] == [("q4_k", 96), ("q6_k", 32), ("q4_k", 16)]
    np.testing.assert_array_equal(runs[0].blocks, np.concatenate([q.blocks, k.blocks]))
    np.testing.assert_array_equal(runs[1].blocks, v.blocks)
    np.testing.assert_array_equal(runs[2].blocks, u.blocks)
    [one] = stack_segments([q, k])
    np.testing.assert_array_equal(one.blocks, np.concatenate([q.blocks, k.blocks]))
    q5, k5, v8 = (quantize((rng.standard_normal((r, 576)) * 0.1).astype(np.float32), f)
                  for r, f in [(24, "q5_0"), (8, "q5_0"), (8, "q8_0")])  # a 576-wide Q4_K_M's fallbacks
    assert [(r.fmt, r.rows) for r in stack_segments([q5, k5, v8])] == [("q5_0", 32), ("q8_0", 8)]
    with pytest.raises(QuantError, match="cannot stack matrices of widths \\[256, 512\\]"):
        stack_segments([q, quantize(np.zeros((1, 512), np.float32), "q4_k")])
