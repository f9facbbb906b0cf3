"""pack.cc: the load-time repacking of GGUF blocks into the quantized matmul's layout, against the NumPy reference
(tests/support/qpack_ref.py) byte for byte, and its dequantization against the gguf package's and the loader's
(quant.dequantize) bit for bit; every format, random blocks (any byte pattern: NaN and subnormal scales too), odd
row counts (a narrow last group of 16 columns), on every SIMD variant (the ``lib`` fixture)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from backends.mindspore.kernels import dequantize_qweight, prepare_qweight
from backends.mindspore.modeldir.quant import FORMATS, QuantWeight, dequantize
from tests.support.kernel_entries import call_entry
from tests.support.qpack_ref import pack_qweight, random_blocks

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

ROWS = (1, 15, 16, 17, 37, 50)


def _random(fmt: str, n: int, blocks: int, seed: int, finite: bool = False) -> QuantWeight:
    return random_blocks(fmt, n, blocks, np.random.default_rng(seed), finite)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_matches_the_numpy_reference(kernel_cache, variant, fmt):
    for i, n in enumerate(ROWS):
        q = _random(fmt, n, 3 if i % 2 else 1, seed=i)
        got = prepare_qweight(q, kernel_cache, variant)
        want = pack_qweight(q)
        assert got.shape == want.shape and got.dtype == np.uint8
        assert got.tobytes() == want.tobytes(), f"{fmt} N={n}: first differing byte {np.argmax(got != want)}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantization_is_the_loaders_bits(kernel_cache, variant, fmt):
    for i, n in enumerate(ROWS):
        q = _random(fmt, n, 2, seed=100 + i)
        got = dequantize_qweight(q, kernel_cache, variant)
        with np.errstate(all="ignore"):
            want = dequantize(q)
        nan = np.isnan(want)  # (NaN + NaN: which payload survives is the instruction's choice)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])  # -0.0 too
        finite = _random(fmt, n, 2, seed=200 + i, finite=True)
        ref = gguf_dequantize(finite.blocks, T[fmt.upper()]).reshape(n, finite.cols)
        np.testing.assert_array_equal(dequantize_qweight(finite, kernel_cache, variant), ref)


def test_the_entries_refuse_what_does_not_fit(lib):
    q = _random("q4_k", 5, 2, seed=7)
    blocks, out = q.blocks, np.zeros((1, 2 * 148, 5), np.uint8)

    def pack(fmt_code, b=blocks, o=out) -> int:
        return call_entry(lib, "MindservePackQWeight", [b, np.array([fmt_code], np.int32), o])

    assert pack(5) == 0
    np.testing.assert_array_equal(out, pack_qweight(q))
    assert pack(8) == 3 and pack(-1) == 3  # no such format
    assert pack(6) == 4  # 288 bytes a row are not Q5_K blocks (176)
    assert pack(7, o=np.zeros((1, 2 * 210, 5), np.uint8)) == 4  # 288 bytes a row are not Q6_K blocks (210) either
    assert pack(5, o=np.zeros((1, 2 * 148, 6), np.uint8)) == 4  # the output's N is not the blocks' rows
    assert pack(5, o=np.zeros((1, 2 * 147, 5), np.uint8)) == 4
    assert pack(5, b=blocks.astype(np.float32)) == 2
    code = np.array([5], np.int32)
    assert call_entry(lib, "MindserveDequantize", [blocks, code, np.zeros((5, 511), np.float32)]) == 4
    assert call_entry(lib, "MindserveDequantize", [blocks, code, np.zeros((5, 512), np.uint8)]) == 2
    assert call_entry(lib, "MindserveDequantize", [blocks, code]) == 1

