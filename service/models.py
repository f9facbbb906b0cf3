"""The models one server serves (every ``ModelConfig`` entry, each its own backend): lookup by name, a lease per
request that keeps its model loaded, and loading on demand with the least recently used idle model unloaded
beyond ``maxLoadedModels`` (the rule: ``service/model_lru.py``).

Runs on the event loop; loads and unloads run in a daemon thread, one at a time. A request for a model that
is not loaded waits for its load (bounded by the request's e2e deadline); a model is unloaded only once no
request holds it, so an unload never cuts a request.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from backends.base import Backend
from service.errors import IncompleteGeneration, NotFound, ServiceUnavailable
from service.loading import LOAD_THREAD, LoadingBackend, load_in_background
from service.model_lru import Decision, ModelState, Resident, plan_load
from service.validation import show

if TYPE_CHECKING:
    from backends.loader import ModelCheck
    from service.config import ModelSettings

log = logging.getLogger("mindserve")


class ModelNotFound(NotFound):
    """A request names no served model nor adapter: OpenAI's 404 ``model_not_found`` (``openai.NotFoundError``)."""

    code = "model_not_found"
    param = "model"

    def __init__(self, requested: str, served: Sequence[str], adapters: Sequence[str] = ()) -> None:
        also = f" and the LoRA adapters {', '.join(map(show, adapters))}" if adapters else ""
        super().__init__(f"model {show(requested)} is not served here; this server serves "
                         f"{', '.join(map(show, served))}{also}")


@dataclass(eq=False)
class ModelSlot:
    """One served model: its stand-in backend (``LoadingBackend``), how to load it, and its load history."""

    backend: LoadingBackend
    load: Callable[[], Backend] | None  # None: always loaded (a backend handed in ready)
    state: ModelState = ModelState.UNLOADED
    in_flight: int = 0
    last_used: float = 0.0  # monotonic
    last_used_at: float | None = None  # unix seconds, for /info
    loads: int = 0
    unloads: int = 0
    load_seconds: list[float] = field(default_factory=list)  # every load's wall time, for /metrics
    waiters: list[asyncio.Future] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.backend.model_name

    def touch(self) -> None:
        self.last_used, self.last_used_at = time.monotonic(), time.time()

    def describe(self) -> dict:
        """This model's entry of ``/info``'s ``mindserve.models``."""
        return {"name": self.name, "state": self.state.value, "in_flight": self.in_flight,
                "last_used": self.last_used_at, "loads": self.loads, "unloads": self.unloads,
                "last_load_seconds": round(self.load_seconds[-1], 3) if self.load_seconds else None,
                "adapters": [a["name"] for a in self.backend.adapters()]}


@dataclass(frozen=True, slots=True)
class ModelLease:
    """A request's hold on its model: the backend stays loaded until ``release`` (idempotent)."""

    backend: Backend
    _release: Callable[[], None]

    def release(self) -> None:
        self._release()


class ModelRegistry:
    """Every served model, the first being the one routes without a ``model`` field serve."""

    def __init__(self, slots: Sequence[ModelSlot], max_loaded: int = 0) -> None:
        if not slots:
            raise ValueError("a server serves at least one model")
        self.slots = tuple(slots)
        self.limit = min(max_loaded or len(self.slots), len(self.slots))
        self._by_name = {slot.name: slot for slot in self.slots}
        self._pending: collections.deque[ModelSlot] = collections.deque()  # slots waiting for a load, in order
        self._busy = False  # a load or an unload is running

    @classmethod
    def of_backend(cls, backend: Backend) -> ModelRegistry:
        """One model, loaded already (the tests' ``make_app(engine)``); a LoadingBackend stays as it is."""
        if isinstance(backend, LoadingBackend):
            return cls([ModelSlot(backend, None, ModelState.LOADED)])
        stand_in = LoadingBackend(backend.model_name, getattr(backend, "config", None))
        stand_in.attach(backend)
        return cls([ModelSlot(stand_in, None, ModelState.LOADED)])

    @property
    def first(self) -> LoadingBackend:
        return self.slots[0].backend

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    def slot(self, name: str | None) -> ModelSlot:
        """The slot serving ``name`` (a model, or one of its LoRA adapters; None: the first model); an unknown
        name is ``ModelNotFound`` (OpenAI's 404 model_not_found) listing what is served."""
        if name is None:
            return self.slots[0]
        found = self._by_name.get(name) or next(
            (s for s in self.slots if any(a["name"] == name for a in s.backend.adapters())), None)
        if found is None:
            adapters = sorted(a["name"] for s in self.slots for a in s.backend.adapters())
            raise ModelNotFound(name, self.names, adapters)
        return found

    # --- start-up and shutdown ---------------------------------------------------------------------

    async def preload(self) -> None:
        """Load the first ``limit`` models, one after the other (start-up); raises the first load's failure."""
        for slot in self.slots[:self.limit]:
            if slot.state is ModelState.LOADED:
                continue
            slot.state, started = ModelState.LOADING, time.monotonic()
            if self.limit > 1:
                log.info("loading model %s", slot.name)
            try:
                await load_in_background(slot.load, into=slot.backend)
            except BaseException:
                slot.state = ModelState.UNLOADED
                raise
            self._mark_loaded(slot, time.monotonic() - started)

    def close(self) -> None:
        """Close every backend (what is in flight fails); a load still running closes its backend when done."""
        for slot in self.slots:
            slot.backend.close()

    # --- requests ----------------------------------------------------------------------------------

    async def acquire(self, name: str | None, timeout: float) -> ModelLease:
        """A lease on the model serving ``name``, loading it first if need be (waiting at most ``timeout``
        seconds: then the e2eTimeout error). ``ModelNotFound`` for an unknown name; 503 if its load fails."""
        slot = self.slot(name)
        if slot.state is ModelState.LOADED:
            return self._lease(slot)
        granted: asyncio.Future = asyncio.get_running_loop().create_future()
        slot.waiters.append(granted)
        if slot.state is not ModelState.LOADING and slot not in self._pending:
            self._pending.append(slot)
            log.info("model %s is %s: loading it for a request", slot.name, slot.state.value)
        self._rebalance()
        try:
            await asyncio.wait_for(asyncio.shield(granted), timeout)
        except asyncio.TimeoutError:
            self._leave(slot, granted)
            raise IncompleteGeneration(f"waited {timeout:g} s for model {slot.name!r} to load (e2eTimeout)") from None
        except BaseException:
            self._leave(slot, granted)
            raise
        return ModelLease(slot.backend.loaded_backend, self._releaser(slot))

    def _lease(self, slot: ModelSlot) -> ModelLease:
        slot.in_flight += 1
        slot.touch()
        return ModelLease(slot.backend.loaded_backend, self._releaser(slot))

    def _releaser(self, slot: ModelSlot) -> Callable[[], None]:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(slot)
        return release

    def _release(self, slot: ModelSlot) -> None:
        slot.in_flight -= 1
        slot.touch()
        if slot.state is ModelState.UNLOADING and slot.in_flight == 0:
            self._start_unload(slot)

    def _leave(self, slot: ModelSlot, granted: asyncio.Future) -> None:
        """A waiter gave up (timeout, client gone): out of the line, its lease given back if it got one."""
        if granted in slot.waiters:
            slot.waiters.remove(granted)
        if granted.done() and not granted.cancelled() and granted.exception() is None:
            self._release(slot)
        granted.cancel()

    # --- loading and unloading ---------------------------------------------------------------------

    def _rebalance(self) -> None:
        """Start the next load, or the unload that makes room for it (one operation at a time)."""
        while self._pending and not self._busy:
            slot = self._pending[0]
            slot.waiters = [w for w in slot.waiters if not w.done()]
            if not slot.waiters or slot.state is ModelState.LOADED:
                self._pending.popleft()  # nobody waits any more, or it is loaded
                self._grant(slot)
                continue
            if slot.state is not ModelState.UNLOADED:
                return  # it drains first; its unload calls back here
            plan = plan_load([Resident(s.name, s.state, s.in_flight, s.last_used) for s in self.slots], self.limit)
            if plan.decision is Decision.LOAD:
                self._pending.popleft()
                self._start_load(slot)
            elif plan.decision is Decision.EVICT:
                victim = self._by_name[plan.victim]
                victim.state = ModelState.UNLOADING
                log.info("maxLoadedModels %d reached: unloading %s (least recently used%s) to load %s", self.limit,
                         victim.name, f"; draining {victim.in_flight} requests" if victim.in_flight else ", idle",
                         slot.name)
                if victim.in_flight == 0:
                    self._start_unload(victim)
                return
            else:
                return

    def _start_load(self, slot: ModelSlot) -> None:
        self._busy, started = True, time.monotonic()
        slot.state = ModelState.LOADING
        log.info("loading model %s", slot.name)
        loading = load_in_background(slot.load, into=slot.backend)
        loading.add_done_callback(lambda f: self._load_done(slot, f, time.monotonic() - started))

    def _load_done(self, slot: ModelSlot, future: asyncio.Future, seconds: float) -> None:
        self._busy = False
        error = future.exception()
        if error is None:
            self._mark_loaded(slot, seconds)
            self._grant(slot)
        else:
            slot.state = ModelState.UNLOADED
            log.error("model %s could not be loaded: %s: %s", slot.name, type(error).__name__, error)
            for waiter in slot.waiters:
                if not waiter.done():
                    waiter.set_exception(ServiceUnavailable(f"model {slot.name!r} could not be loaded: {error}"))
            slot.waiters = []
        self._rebalance()

    def _mark_loaded(self, slot: ModelSlot, seconds: float) -> None:
        slot.state = ModelState.LOADED
        slot.loads += 1
        slot.load_seconds.append(seconds)
        slot.touch()
        log.info("model %s loaded in %.1fs (%d of maxLoadedModels %d loaded)", slot.name, seconds,
                 sum(s.state is ModelState.LOADED for s in self.slots), self.limit)

    def _grant(self, slot: ModelSlot) -> None:
        """Every request waiting for ``slot`` gets its lease (it is loaded)."""
        if slot.state is not ModelState.LOADED:
            return
        for waiter in slot.waiters:
            if not waiter.done():
                slot.in_flight += 1
                waiter.set_result(None)
        slot.waiters = []
        slot.touch()

    def _start_unload(self, slot: ModelSlot) -> None:
        self._busy = True
        loop, started = asyncio.get_running_loop(), time.monotonic()

        def run() -> None:
            backend = slot.backend.detach()
            try:
                if backend is not None:
                    backend.close()
                    del backend
                free_memory()
            finally:
                loop.call_soon_threadsafe(self._unload_done, slot, time.monotonic() - started)

        threading.Thread(target=run, name=LOAD_THREAD, daemon=True).start()

    def _unload_done(self, slot: ModelSlot, seconds: float) -> None:
        self._busy = False
        slot.state = ModelState.UNLOADED
        slot.unloads += 1
        log.info("model %s unloaded in %.1fs", slot.name, seconds)
        self._rebalance()

    # --- what /info and /metrics show ---------------------------------------------------------------

    def describe(self) -> list[dict]:
        return [slot.describe() for slot in self.slots]


def registry_for(models: Sequence[ModelSettings], max_loaded: int, prepare: Callable[[ModelSettings], Path],
                 checks: Sequence[ModelCheck] = ()) -> ModelRegistry:
    """The registry of a server config's models, none loaded yet: each loads with ``prepare(model)`` (its model
    directory) and its engine settings. With several models resident at once, each engine takes the KV cache
    that start-up's memory check planned for it (``checks``, ``service/preflight.check_models``) rather than
    sizing its own from what is free when it loads."""
    from backends.loader import load_backend

    resident = min(max_loaded or len(models), len(models))
    plans = {i: check.cache for i, check in enumerate(checks) if check.cache is not None and resident > 1}

    def loader(i: int, model: ModelSettings) -> Callable[[], Backend]:
        engine = plans[i].apply(model.engine) if i in plans else model.engine
        return lambda: load_backend(model.backend_type, prepare(model), engine, model_name=model.name, progress=True)

    return ModelRegistry([ModelSlot(LoadingBackend(m.name, m.engine), loader(i, m)) for i, m in enumerate(models)],
                         max_loaded)


def free_memory() -> None:
    """Give a closed engine's memory back: collect its cycles (``serve`` froze the start-up objects out of the
    collector's sight: thaw them first), then return freed heap pages to the system (glibc ``malloc_trim``)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
