"""The decoder layers as one op of few inputs (``decoder_stack``, kernels/stack.cc): MindSpore's own time around an
op grows with its inputs, and one decoder layer op takes 18-22 (docs/performance.md, "One op for the layers"). The
layers' weights, norms, metadata and KV caches stay the network's Parameters (its cells register them, the cache
views, the page mapper and the prefix cache read them as before); the op gets a layout table of their memory instead,
each row (address, ndim, dims, dtype code), or a placeholder for one of the step's rope inputs.

``layer_stack`` makes it where it can: every layer a stackable kind (``stack_kind``) with groups of one size, every
Parameter's memory its own (``memory_view``), and ``MINDSERVE_STACK_LAYERS`` not 0 (one op a layer: the same bits,
for measurements)."""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn

from backends.mindspore.network.common import memory_view

STACK_LAYERS = os.environ.get("MINDSERVE_STACK_LAYERS", "1") != "0"
_DTYPE_CODES = {ms.float32: 0, ms.int32: 1, ms.uint8: 2, ms.float16: 3, ms.bfloat16: 4}  # stack.cc's kDtypes


@dataclass(frozen=True)
class Rope:
    """The step's rope input ``k`` (0 cos, 1 sin; Gemma 3's local pair 2, 3) in a layer's group."""

    k: int


@dataclass(frozen=True)
class LayerStack:
    """``decoder_stack``'s (layers, inputs a layer, kind) and layout table; ``keep``: the host copies of the plain
    Tensors (metadata, eps) whose addresses the table holds."""

    meta: Tensor
    layout: Parameter
    keep: tuple[np.ndarray, ...]


def layer_stack(layers: nn.CellList, ropes: Callable[[nn.Cell], tuple[Rope, Rope]] = lambda _: (Rope(0), Rope(1)),
                name: str = "stack_layout") -> LayerStack | None:
    """The stack of ``layers`` (each layer's ``stack_inputs`` with ``ropes(layer)`` for its cos and sin), or None."""
    kinds = {type(layer).stack_kind for layer in layers}
    if not STACK_LAYERS or len(kinds) != 1 or None in kinds:
        return None
    groups = [layer.stack_inputs(*ropes(layer)) for layer in layers]
    if len({len(g) for g in groups}) != 1:
        return None
    rows, keep = [], []
    for item in (item for g in groups for item in g):
        row = _row(item, keep)
        if row is None:
            return None
        rows.append(row)
    layout = Parameter(Tensor(np.array(rows, np.int64)), name=name, requires_grad=False)
    meta = Tensor(np.array([len(groups), len(groups[0]), kinds.pop()], np.int32))
    return LayerStack(meta, layout, tuple(keep))


def _row(item, keep: list[np.ndarray]) -> list[int] | None:
    if isinstance(item, Rope):
        return [0, -1 - item.k, 0, 0, 0, 0]
    if item.dtype not in _DTYPE_CODES or not 1 <= len(item.shape) <= 3:
        return None
    if isinstance(item, Parameter):
        view = memory_view(item)  # the memory the kernels read and write, or None: this MindSpore copies
        if view is None:
            return None
    else:  # a constant the graph never writes: a host copy of it, kept as long as the network
        view = np.ascontiguousarray(item.asnumpy())
        keep.append(view)
    return [view.ctypes.data, len(item.shape), *_dims(item.shape), _DTYPE_CODES[item.dtype]]


def _dims(shape: Sequence[int]) -> list[int]:
    return [*shape, *[0] * (3 - len(shape))]
