"""MindserveDecoderStack (stack.cc): a model's decoder layers as one op, their inputs given by a layout table of
addresses, give the bits of the layer entries called one after the other (the output, and every layer's cache rows),
and a bad argument is a return code naming it. (Not among kernel_entries.py's cases, which the NEON driver runs in a
process of its own: the layout holds this process's addresses. The stack only calls the layer entries those cover.)"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.support.kernel_entries import call_entry, cases

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

LAYER_ENTRY = {0: "MindserveDecoderLayer", 1: "MindserveGemmaDecoderLayer", 2: "MindserveMoEDecoderLayer"}
CASE = {0: "decoder-layer", 1: "gemma-decoder-layer", 2: "moe-decoder-layer"}  # kernel_entries.py's
CODES = {np.dtype(np.float32): 0, np.dtype(np.int32): 1, np.dtype(np.uint8): 2, np.dtype(np.float16): 3}
SHARED = range(9, 13)  # write, table, pos, rows: every layer entry's inputs 9-12
COS, SIN = 5, 6  # the layer entries' cos and sin inputs


def _layers(kind: int, n: int, rng) -> tuple[list[np.ndarray], list[list[np.ndarray]], list[np.ndarray]]:
    """(x, write, table, pos, rows), n layers' inputs (each its own attention norm and caches; x, cos and sin None),
    and the rope inputs: layer i uses pair i % 2, the second pair its own rows."""
    base = next(c for c in cases() if c.name == CASE[kind]).arrays
    ropes = [base[COS], base[SIN], *(r + np.float32(0.25) for r in (base[COS], base[SIN]))]
    layers = []
    for _ in range(n):
        inputs = [np.array(a, copy=True) for a in base[:-1]]
        inputs[1] = rng.standard_normal(base[1].shape).astype(np.float32)
        inputs[0] = inputs[COS] = inputs[SIN] = None
        layers.append(inputs)
    return [base[0], *(base[i] for i in SHARED)], layers, ropes


def _layout(layers: list[list[np.ndarray]]) -> np.ndarray:
    rows = []
    for i, inputs in enumerate(layers):
        for j, a in enumerate(inputs):
            if j == 0 or j in SHARED:
                continue
            if a is None:  # cos or sin: the layer's rope pair
                rows.append([0, -1 - (2 * (i % 2) + (j == SIN)), 0, 0, 0, 0])
            else:
                rows.append([a.ctypes.data, a.ndim, *a.shape, *[0] * (3 - a.ndim), CODES[a.dtype]])
    return np.array(rows, np.int64)


def _stack(lib, kind, shared, layers, ropes, out, smeta=None, layout=None) -> int:
    p = len(layers[0]) - 1 - len(SHARED)
    smeta = np.array([len(layers), p, kind], np.int32) if smeta is None else smeta
    layout = _layout(layers) if layout is None else layout
    return call_entry(lib, "MindserveDecoderStack", [*shared, smeta, layout, *ropes, out])


@pytest.mark.parametrize("kind, n", [(0, 3), (1, 2), (2, 2)])
def test_the_stack_is_its_layers_called_in_order_bit_for_bit(lib, kind, n):
    shared, layers, ropes = _layers(kind, n, np.random.default_rng(kind))
    apart = [[None if a is None else a.copy() for a in inputs] for inputs in layers]
    y = np.full_like(shared[0], np.nan)
    assert _stack(lib, kind, shared, layers, ropes, y) == 0
    x = shared[0]
    for i, inputs in enumerate(apart):  # the layers one by one, each on its own copies of its caches
        args = list(inputs)
        args[0], args[COS], args[SIN] = x, ropes[2 * (i % 2)], ropes[2 * (i % 2) + 1]
        for j, s in zip(SHARED, shared[1:]):
            args[j] = s
        out = np.full_like(x, np.nan)
        assert call_entry(lib, LAYER_ENTRY[kind], [*args, out]) == 0
        x = out
    assert np.array_equal(y, x) and not np.array_equal(y, shared[0])
    for stacked, alone in zip(layers, apart):  # every layer's caches (inputs 7 and 8) as the layer wrote them
        assert np.array_equal(stacked[7], alone[7]) and np.array_equal(stacked[8], alone[8])
    assert not np.array_equal(layers[0][7], _layers(kind, n, np.random.default_rng(kind))[1][0][7])  # written


def test_a_stack_names_its_bad_arguments(lib):
    shared, layers, ropes = _layers(0, 3, np.random.default_rng(7))
    y = np.zeros_like(shared[0])
    p = len(layers[0]) - 1 - len(SHARED)
    layout = _layout(layers)
    assert _stack(lib, 0, shared, layers, ropes, y, smeta=np.array([3, p], np.int32)) == 2  # smeta of two values
    assert _stack(lib, 0, shared, layers, ropes, y, layout=layout.astype(np.int32)) == 2  # not int64
    assert _stack(lib, 0, shared, layers, ropes, y, smeta=np.array([3, p, 7], np.int32)) == 3  # no such kind
    assert _stack(lib, 0, shared, layers, ropes, y, layout=layout[:-1]) == 3  # a row short of 3 layers
    assert _stack(lib, 0, shared, layers, ropes, np.zeros((y.shape[0] + 1, y.shape[1]), np.float32)) == 4
    bad = layout.copy()
    bad[3, 1] = -3  # rope input 2 of the 2 given
    assert _stack(lib, 0, shared, layers, ropes[:2], y, layout=bad) == 5
    bad = layout.copy()
    bad[0, 5] = 9  # no such dtype
    assert _stack(lib, 0, shared, layers, ropes, y, layout=bad) == 5
    write = shared[1].copy()
    write[0] = -1  # a cache row outside every cache: the first layer's attention stage (2) refuses it
    assert _stack(lib, 0, [shared[0], write, *shared[2:]], layers, ropes, y) == 1000 + 208
