"""What a model's load is doing: the seconds of each phase (read weights, pack weights, KV cache, kernels...) and a
progress line at most every few seconds while the layers are built.

``build_parts`` opens one ``LoadClock`` for the load (``with LoadClock(...)``); the code of each phase, however deep
(the network's weight packing, its caches), times itself with ``phase(name, what)`` or the ``timed(name)``
decorator, which do nothing outside a load. The clock travels in a context variable rather than through every
network constructor's arguments: it only observes, and the load runs on one thread."""
from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

log = logging.getLogger("mindserve.engine")
F = TypeVar("F", bound=Callable)

_CURRENT: contextvars.ContextVar[LoadClock | None] = contextvars.ContextVar("mindserve_load_clock", default=None)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class LoadClock:
    """Seconds per phase of one load; ``progress`` lines at most every ``every`` seconds."""

    def __init__(self, layers: int, every: float = 5.0) -> None:
        self.layers, self.every = layers, every
        self.seconds: dict[str, list[float]] = {}  # phase -> [wall seconds, CPU seconds of the process]
        self.started = self._last = time.perf_counter()
        self._token: contextvars.Token | None = None

    def __enter__(self) -> LoadClock:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._token)

    def add(self, name: str, seconds: float, cpu: float, what: str = "") -> None:
        total = self.seconds.setdefault(name, [0.0, 0.0])
        total[0] += seconds
        total[1] += cpu
        now = time.perf_counter()
        if now - self._last >= self.every:
            self._last = now
            layer = _LAYER.match(what)
            where = f"layer {int(layer.group(1)) + 1}/{self.layers}" if layer else what or f"{name} done"
            log.info("loading: %s (%s; %.0fs so far)", where, self.summary(), now - self.started)

    def summary(self, cpu: bool = False) -> str:
        """``read weights 8.1s, pack weights 3.2s, ...`` in the order the phases first ran; with ``cpu`` each phase's
        CPU seconds (every thread of the process) too: ``pack weights 3.2s (CPU 2.9s)``."""
        return ", ".join(f"{name} {wall:.1f}s" + (f" (CPU {c:.1f}s)" if cpu else "")
                         for name, (wall, c) in self.seconds.items())


@contextmanager
def phase(name: str, what: str = "") -> Iterator[None]:
    """Time the block as phase ``name`` of the current load (``what``: the item, e.g. a parameter's name)."""
    clock = _CURRENT.get()
    if clock is None:
        yield
        return
    start, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        clock.add(name, time.perf_counter() - start, time.process_time() - cpu, what)


def timed(name: str) -> Callable[[F], F]:
    """Decorator: each call of the function is phase ``name`` of the current load, its ``name`` argument (a
    parameter's name) the item."""
    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with phase(name, signature.bind(*args, **kwargs).arguments.get("name", "")):
                return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap
