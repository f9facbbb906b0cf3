"""The adapter slots' layout, as the layers read it and ``engine/lora_slots.py`` writes it. Per layer there are
four groups, one per fused projection of the network: ``qkv`` (q, k, v), ``o``, ``gate_up`` (gate, up) and
``down``. A group of G projections over input size K and output columns N holds ``a [S, K, G*R]`` (slot s's
shrink factors: projection g's lora_A transposed in columns g*R .. g*R + r) and ``b [S, R, N]`` (its lora_B
transposed, times the module's scale, in projection g's output columns). Ranks below R and projections an adapter
does not touch stay zero, so they add exact zeros."""
from __future__ import annotations

import itertools

from backends.lora import BaseDims

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def group_segments(dims: BaseDims, group: str) -> list[int]:
    """Output-column boundaries of a group's projections: [0, n_0, n_0 + n_1, ...]."""
    return [0, *itertools.accumulate(dims.shape(p)[1] for p in GROUPS[group])]


def group_shapes(dims: BaseDims, group: str, slots: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a group's ``a`` and ``b`` arrays."""
    projections = GROUPS[group]
    k = dims.shape(projections[0])[0]
    n = group_segments(dims, group)[-1]
    return (slots, k, len(projections) * rank), (slots, rank, n)
