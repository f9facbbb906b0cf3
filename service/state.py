"""Process readiness: not ready until the backend is warmed up and every plane listens; draining on shutdown.

One ``ServerState`` is shared by the apps of all planes (business, management, metrics) of a process.
"""
from __future__ import annotations

import threading
import time


class ServerState:
    """``ready``: serve traffic (``/health`` 200); ``draining``: shutting down (``/health`` 503 again)."""

    def __init__(self, *, ready: bool = False) -> None:
        self.started_at = time.time()  # unix seconds; the ``created`` of ``/v1/models``
        self._ready = threading.Event()
        self._draining = threading.Event()
        if ready:
            self._ready.set()

    def mark_ready(self) -> None:
        self._ready.set()

    def start_draining(self) -> None:
        self._draining.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._draining.is_set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def describe(self) -> str:
        """Why the server is not ready ("" when it is)."""
        if self.draining:
            return "the server is shutting down"
        if not self._ready.is_set():
            return "the model is still loading or warming up"
        return ""
