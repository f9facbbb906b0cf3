"""Which model makes room for a load when ``maxLoadedModels`` are resident: the pure rule the model registry
(``service/models.py``) asks, one load at a time.

A model is UNLOADED, LOADING, LOADED or UNLOADING (draining: no new request, those in flight finish, then its
engine closes). Every state but UNLOADED holds memory (or is about to), so counts against the limit. The
victim is the least recently used LOADED model with no request in flight; when every loaded model is busy,
the least recently used one drains (its requests finish; new ones for it wait for its reload), so a load is
never starved by a model that always has traffic.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(frozen=True, slots=True)
class Resident:
    """What the rule needs of one model."""

    name: str
    state: ModelState
    in_flight: int  # requests holding it (admitted or waiting for a generation slot)
    last_used: float  # monotonic seconds of its last request's start or end


class Decision(enum.Enum):
    LOAD = "load"  # there is room: load now
    EVICT = "evict"  # unload ``victim`` first (it drains if busy), then load
    WAIT = "wait"  # a model is loading or draining already: decide again when it is done


@dataclass(frozen=True, slots=True)
class Plan:
    decision: Decision
    victim: str | None = None


def plan_load(models: Sequence[Resident], limit: int) -> Plan:
    """What to do to load one more model when ``models`` are as given and at most ``limit`` may hold memory."""
    holding = [m for m in models if m.state is not ModelState.UNLOADED]
    if len(holding) < limit:
        return Plan(Decision.LOAD)
    if any(m.state in (ModelState.UNLOADING, ModelState.LOADING) for m in holding):
        return Plan(Decision.WAIT)
    idle = [m for m in holding if m.in_flight == 0]
    victim = min(idle or holding, key=lambda m: m.last_used)
    return Plan(Decision.EVICT, victim.name)
