"""Adapter slots: the loaded LoRA adapters packed into fixed per-layer arrays the network reads (their layout:
``network/lora_groups.py``), which slot each adapter holds, and who is using it. Weights are never merged: a
step's rows each name a slot (-1 = the base model) and the matmul adds that slot's low-rank delta (kernels/lora.h).
"""
from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from backends.errors import ParameterRejected
from backends.lora import AdapterError, BaseDims, LoraAdapter, load_adapter
from backends.mindspore.network.lora_groups import GROUPS, group_segments, group_shapes
from backends.settings import LoraSettings


def pack_slot(adapter: LoraAdapter | None, layer: int, group: str, dims: BaseDims, rank: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """One slot's ``a [K, G*R]`` and ``b [R, N]`` of one layer's group (zeros where the adapter, or None, has
    no module)."""
    (_, k, gr), (_, r, n) = group_shapes(dims, group, 1, rank)
    a, b = np.zeros((k, gr), np.float32), np.zeros((r, n), np.float32)
    segs = group_segments(dims, group)
    for g, proj in enumerate(GROUPS[group]):
        module = adapter.modules.get((layer, proj)) if adapter is not None else None
        if module is None:
            continue
        rk = module.a.shape[0]
        a[:, g * rank:g * rank + rk] = module.a.T
        b[:rk, segs[g]:segs[g + 1]] = module.b.T * np.float32(module.scale)
    return a, b


@dataclass(slots=True)
class _Slot:
    adapter: LoraAdapter
    generation: int  # unique per load: cached KV blocks of an earlier adapter of the same name never match
    users: int = 0
    unloading: bool = False


@dataclass(eq=False, slots=True)
class Lease:
    """A request's hold on its adapter: the slot its rows name. ``release()`` (once its request ends, any
    number of times) lets an unloading adapter go."""

    name: str
    slot: int
    key: str  # the prefix cache's adapter key
    owner: LoraSlots | None = None
    released: bool = False

    def release(self) -> None:
        if not self.released and self.owner is not None:
            self.released = True
            self.owner._release(self)


class LoraSlots:
    """The adapters held in ``slots`` slots of rank ``rank``; ``write(slot, layer, group, a, b)`` puts one
    slot's factors into the network (the runner's Parameters). Thread-safe: requests acquire and release
    from any thread, loads and unloads come from the management plane."""

    def __init__(self, dims: BaseDims, slots: int, rank: int,
                 write: Callable[[int, int, str, np.ndarray, np.ndarray], None]) -> None:
        self.dims, self.slots, self.rank = dims, slots, rank
        self._write = write
        self._by_slot: dict[int, _Slot] = {}
        self._lock = threading.Lock()
        self._generations = itertools.count(1)

    # --- loading ---

    def load(self, adapter: LoraAdapter) -> int:
        """Put ``adapter`` in a free slot; its slot. ValueError if the name is taken, no slot is free or its
        rank is over the slots' rank."""
        with self._lock:
            if self._find(adapter.name) is not None:
                raise ValueError(f"adapter {adapter.name!r} is already loaded")
            if adapter.rank > self.rank:
                raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over maxLoraRank {self.rank}")
            free = [s for s in range(self.slots) if s not in self._by_slot]
            if not free:
                raise ValueError(f"no free adapter slot: {self.slots} adapters are loaded (maxLoadedLoras)")
            slot = free[0]
            self._by_slot[slot] = _Slot(adapter, next(self._generations), unloading=True)  # not usable yet
        self._fill(slot, adapter)
        with self._lock:
            self._by_slot[slot].unloading = False
        return slot

    def unload(self, name: str) -> bool:
        """Refuse new requests for ``name`` now; free its slot once its last request finishes. True if it was
        freed at once (no request in flight). KeyError if it is not loaded."""
        with self._lock:
            slot = self._find(name)
            if slot is None:
                raise KeyError(name)
            entry = self._by_slot[slot]
            entry.unloading = True
            if entry.users:
                return False
            del self._by_slot[slot]
            return True

    def _fill(self, slot: int, adapter: LoraAdapter | None) -> None:
        for layer in range(self.dims.num_layers):
            for group in GROUPS:
                a, b = pack_slot(adapter, layer, group, self.dims, self.rank)
                self._write(slot, layer, group, a, b)

    # --- requests ---

    def acquire(self, name: str) -> Lease:
        """A lease on ``name`` for one request; ParameterRejected("adapter_id") naming the loaded ones if it is
        not loaded (or being unloaded)."""
        with self._lock:
            slot = self._find(name)
            if slot is None or self._by_slot[slot].unloading:
                loaded = ", ".join(sorted(self.names())) or "none"
                raise ParameterRejected("adapter_id", f"{json.dumps(name)} is not a loaded adapter (loaded: {loaded})")
            entry = self._by_slot[slot]
            entry.users += 1
            return Lease(name, slot, f"{name}#{entry.generation}", self)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            entry = self._by_slot.get(lease.slot)
            if entry is None or entry.adapter.name != lease.name:
                return
            entry.users -= 1
            if entry.unloading and entry.users <= 0:
                del self._by_slot[lease.slot]

    # --- reading ---

    def _find(self, name: str) -> int | None:
        return next((s for s, e in self._by_slot.items() if e.adapter.name == name), None)

    def names(self) -> list[str]:
        """The adapters requests may use now."""
        return [e.adapter.name for e in self._by_slot.values() if not e.unloading]

    def describe(self) -> list[dict]:
        """Each usable adapter's /info entry (name, rank, targets, scale, ...) with its slot and requests."""
        with self._lock:
            return [{**e.adapter.info(), "slot": s, "requests": e.users}
                    for s, e in sorted(self._by_slot.items()) if not e.unloading]


def adapter_fits(adapter: str | None, active: set[str], limit: int) -> bool:
    """``maxLoras``: may a sequence of ``adapter`` (None = the base model) join the ``active`` adapters?"""
    return adapter is None or limit <= 0 or adapter in active or len(active) < limit


class ConfiguredAdapterError(AdapterError):
    """A ``LoraModules`` entry that cannot be used: ``index`` and ``module`` name it, the message says why."""

    def __init__(self, index: int, module, error: AdapterError) -> None:
        ValueError.__init__(self, str(error))  # the adapter's own message, as load_adapter gave it
        self.adapter, self.file, self.key = error.adapter, error.file, error.key
        self.index, self.module = index, module


def load_configured_adapters(lora: LoraSettings, dims: BaseDims) -> list[LoraAdapter]:
    """The ``LoraModules`` adapters, read and checked; ConfiguredAdapterError naming the entry for a bad one."""
    adapters = []
    for i, module in enumerate(lora.modules):
        try:
            adapters.append(load_adapter(module.name, module.path, dims, lora.max_rank or None))
        except AdapterError as exc:
            raise ConfiguredAdapterError(i, module, exc) from exc
    return adapters


def lora_slot_shape(lora: LoraSettings, adapters: list[LoraAdapter]) -> tuple[int, int] | None:
    """(slots, rank) of the adapter slots, None without adapters: maxLoraRank, else the largest configured
    rank (16 when only runtime loads are allowed)."""
    if not lora.enabled:
        return None
    rank = lora.max_rank or max((a.rank for a in adapters), default=16)
    return max(lora.slots, 1), rank


def slot_bytes(dims: BaseDims, shape: tuple[int, int] | None) -> int:
    """Memory the adapter slots of ``shape`` (slots, rank) take: every layer's a and b of the four groups,
    float32, twice (the network's Parameters and the host copy a load writes into)."""
    if shape is None:
        return 0
    slots, rank = shape
    floats = sum(math.prod(a) + math.prod(b) for a, b in (group_shapes(dims, g, slots, rank) for g in GROUPS))
    return 2 * 4 * dims.num_layers * floats
