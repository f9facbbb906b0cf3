"""A backend for handler-only tests: each request emits tokens on its own thread at a set pace.

It implements the ``backends.base.Backend`` protocol without a model, so tests can make requests
slow, stall or fail at will and see whether the service cancelled them.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import Listener, RequestHandle
from backends.errors import GenerationFailed
from backends.types import (
    FinishReason,
    GenerationResult,
    MediaInput,
    RequestParams,
    Token,
    TokenEvent,
)


@dataclass(frozen=True)
class Pace:
    """``tokens`` tokens, ``delay`` s apart (the first after ``first_delay``, default ``delay``);
    ``stall_after``: after that many tokens, go silent for ``stall`` s; ``fail_after``: then a
    GenerationFailed instead of the next token."""

    tokens: int = 3
    delay: float = 0.0
    first_delay: float | None = None
    stall_after: int | None = None
    stall: float = 0.0
    fail_after: int | None = None


class FakeBackend:
    model_name = "fake"

    def __init__(self, pace: Pace = Pace(), media_kinds: frozenset[str] = frozenset()) -> None:
        self.pace = pace
        self.media_kinds = media_kinds  # what it claims to take beside text (it only records the media)
        self.media: list[tuple[str, tuple[MediaInput, ...]]] = []  # (prompt, media) of each request with media
        self.handles: list[RequestHandle] = []
        self.running = 0  # requests whose thread has not ended
        self._lock = threading.Lock()

    def submit(self, inputs: str, params: RequestParams, listener: Listener | None = None,
               media: tuple[MediaInput, ...] = ()) -> RequestHandle:
        handle = RequestHandle(f"fake-{len(self.handles) + 1}", listener)
        with self._lock:
            if media:
                self.media.append((inputs, media))
            self.handles.append(handle)
            self.running += 1
        threading.Thread(target=self._run, args=(handle, params), daemon=True).start()
        return handle

    def _run(self, handle: RequestHandle, params: RequestParams) -> None:
        try:
            self._emit_all(handle, params)
        finally:
            with self._lock:
                self.running -= 1

    def _emit_all(self, handle: RequestHandle, params: RequestParams) -> None:
        pace = self.pace
        n = min(pace.tokens, params.max_new_tokens or pace.tokens)
        for i in range(n):
            wait = pace.delay if i or pace.first_delay is None else pace.first_delay
            if pace.stall_after is not None and i == pace.stall_after:
                wait += pace.stall
            if not self._hold(handle, i) or not _sleep_unless_cancelled(handle, wait):
                handle.emit(GenerationResult("a" * i, FinishReason.STOP_SEQUENCE, 1, i, 1))
                return
            if pace.fail_after is not None and i == pace.fail_after:
                handle.emit(GenerationFailed("injected fault"))
                return
            handle.emit(TokenEvent(Token(i, "a", -0.5, False), i, "a", last=i == n - 1))
        handle.emit(GenerationResult("a" * n, FinishReason.LENGTH, 1, n, 1))

    def _hold(self, handle: RequestHandle, index: int) -> bool:
        """Called before token ``index`` is made; False: the request was cancelled meanwhile (GatedBackend)."""
        return True

    def count_tokens(self, text: str) -> int:
        return max(1, len(text.split()))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(self.count_tokens(text)))

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join("w" for _ in ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return ["w" for _ in ids]

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        return "".join(str(m.get("content")) for m in messages)

    def info(self) -> dict:
        return {"model_name": self.model_name, "running": self.running}

    def adapters(self) -> list[dict]:
        return []

    def load_adapter(self, name: str, path: str) -> dict:
        raise ValueError("the fake backend has no adapter slots")

    def unload_adapter(self, name: str) -> bool:
        raise KeyError(name)

    def close(self) -> None:
        pass

    def cancelled(self) -> list[bool]:
        return [h.cancelled for h in self.handles]


class GatedBackend(FakeBackend):
    """The fake backend whose requests wait at a gate before token ``hold_at`` (0: before any token) until the
    test opens it (``open()``), the request is cancelled, or ``cap`` s pass (``capped`` counts those: a test that
    hung on the gate). A test waits for a state (requests held, slots taken), never for a time."""

    def __init__(self, pace: Pace = Pace(), hold_at: int = 0, cap: float = 30.0) -> None:
        super().__init__(pace)
        self.hold_at, self.cap = hold_at, cap
        self.gate = threading.Event()
        self.at_gate = 0  # requests waiting at the gate now
        self.capped = 0  # requests the cap let through

    def open(self) -> None:
        self.gate.set()

    def _hold(self, handle: RequestHandle, index: int) -> bool:
        if index != self.hold_at:
            return True
        deadline = time.monotonic() + self.cap
        with self._lock:
            self.at_gate += 1
        try:
            while not self.gate.wait(0.005):
                if handle.cancelled:
                    return False
                if time.monotonic() >= deadline:
                    with self._lock:
                        self.capped += 1
                    break
            return True
        finally:
            with self._lock:
                self.at_gate -= 1


def _sleep_unless_cancelled(handle: RequestHandle, seconds: float) -> bool:
    """Sleep; False (early) once the request is cancelled."""
    deadline = time.monotonic() + seconds
    while True:
        if handle.cancelled:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, 0.005))
