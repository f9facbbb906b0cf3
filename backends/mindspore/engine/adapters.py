"""The engine's LoRA adapters: the configured ones read before anything is allocated (their slots count in the
memory budget), put into the network's slots once it exists, a lease for each request that names one, and
loads and unloads at run time (the management plane). The slots themselves are ``lora_slots.LoraSlots``.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from backends.errors import ParameterRejected
from backends.lora import BaseDims, load_adapter
from backends.mindspore.families import refuse_adapters
from backends.mindspore.engine.lora_slots import (ConfiguredAdapterError, Lease, LoraSlots, load_configured_adapters,
                                                  lora_slot_shape, slot_bytes)

__all__ = ["ConfiguredAdapterError", "EngineAdapters"]
from backends.settings import LoraSettings

log = logging.getLogger("mindserve.engine")

Writer = Callable[[int, int, str, np.ndarray, np.ndarray], None]  # ModelRunner.write_lora
BetweenSteps = Callable[[Callable[[], object]], Future]  # Engine._between_steps


class EngineAdapters:
    """``shape`` is (slots, rank), None without adapters; ``attach`` gives them the network to write into."""

    def __init__(self, spec, settings: LoraSettings) -> None:
        refuse_adapters(spec.arch, settings.enabled)  # a family without adapter slots: before anything is read
        self.dims, self.settings = BaseDims.of(spec), settings
        self._configured = load_configured_adapters(settings, self.dims)
        self.shape = lora_slot_shape(settings, self._configured)
        self.slots: LoraSlots | None = None

    @property
    def bytes(self) -> int:
        """What the slots will take in memory (for the budget)."""
        return slot_bytes(self.dims, self.shape)

    def attach(self, write: Writer) -> None:
        """Create the slots over the network's arrays and load the configured adapters into them."""
        if self.shape is None:
            return
        self.slots = LoraSlots(self.dims, *self.shape, write)
        for adapter in self._configured:
            slot = self.slots.load(adapter)
            log.info("loaded LoRA adapter %s from %s (rank %d, scale %g, targets %s) into slot %d", adapter.name,
                     adapter.path, adapter.rank, adapter.scale, ",".join(adapter.targets), slot)
        self._configured = []

    def lease(self, adapter_id: str | None) -> Lease | None:
        """A request's hold on its adapter (None: the base model); ParameterRejected if it is not loaded."""
        if adapter_id is None:
            return None
        if self.slots is None:
            raise ParameterRejected("adapter_id", f"{json.dumps(adapter_id)} is not a loaded adapter (loaded: none; "
                                                  "the server config has no LoraModules)")
        return self.slots.acquire(adapter_id)

    def describe(self) -> list[dict]:
        """The loaded adapters (name, rank, targets, scale, use_rslora, slot, requests in flight)."""
        return self.slots.describe() if self.slots is not None else []

    def info(self) -> dict | None:
        if self.slots is None:
            return None
        return {"slots": self.slots.slots, "rank": self.slots.rank, "max_loras": self.settings.max_loras,
                "runtime_updates": self.settings.runtime_updates}

    def load(self, name: str, path: Path | str, between_steps: BetweenSteps) -> dict:
        """Read and check a PEFT adapter (here, in the caller's thread), then put it in a free slot between two
        steps; its /info entry. AdapterError for a bad adapter, ValueError if it cannot be held."""
        if self.slots is None:
            raise ValueError("this server has no adapter slots (set LoraModules or allowRuntimeLoraUpdating)")
        adapter = load_adapter(name, path, self.dims, self.slots.rank)
        between_steps(lambda: self.slots.load(adapter)).result(timeout=60)
        log.info("loaded LoRA adapter %s from %s at run time (rank %d, scale %g)", name, path, adapter.rank,
                 adapter.scale)
        return next(a for a in self.describe() if a["name"] == name)

    def unload(self, name: str) -> bool:
        """New requests for ``name`` are refused from now on; its slot is freed once the ones in flight end
        (True: at once). KeyError if it is not loaded."""
        if self.slots is None:
            raise KeyError(name)
        freed = self.slots.unload(name)
        log.info("unloaded LoRA adapter %s (%s)", name, "slot freed" if freed else "slot freed when its requests end")
        return freed
