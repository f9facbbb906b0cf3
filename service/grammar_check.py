"""A request's grammar checked before it takes a generation slot (``service/pipeline.py``).

The backend's ``check_grammar`` compiles the grammar and runs its first steps (``backends/grammar.py``:
where llguidance's lexer meets its limits). That is CPU work of up to a few seconds for the worst grammars,
bounded by llguidance's fuel, so it runs off the event loop on one thread of its own (a flood of hostile
grammars queues there, not in the executor that submits requests), and the request waits for it at most
``CHECK_SECONDS`` (and never past its e2eTimeout): then it is refused like a grammar over a limit.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from backends.base import Backend
from backends.errors import ParameterRejected
from backends.types import Grammar

CHECK_SECONDS = 10.0  # the longest a request waits for its grammar's check (queue included)


class GrammarCheck:
    """One thread that checks grammars for the app's requests, started on the first grammar."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mindserve-grammar-check")
            return self._pool

    async def check(self, backend: Backend, grammar: Grammar | None, timeout: float = CHECK_SECONDS) -> None:
        """Return when ``grammar`` is fine (or there is none, or the backend has no check); else raise the
        backend's ``ParameterRejected("grammar", …)`` (the dialect names its field)."""
        check = getattr(backend, "check_grammar", None)
        if grammar is None or check is None:
            return
        future = asyncio.get_running_loop().run_in_executor(self._executor(), check, grammar)
        try:
            await asyncio.wait_for(future, max(timeout, 0.0))
        except asyncio.TimeoutError:
            raise ParameterRejected("grammar", f"the {grammar.kind} grammar could not be checked within "
                                               f"{timeout:g} s; simplify it") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
