"""Back-pressure and time limits of the generation routes.

``Admission``: at most ``maxLinkNum`` requests in flight and ``2 × maxLinkNum`` waiting for a slot, first
come first served (the reference server: a pool of ``maxLinkNum`` workers and a queue twice that size);
one more is a 429. ``Deadlines``: ``tokenTimeout`` (before the first token and between two tokens) and
``e2eTimeout`` (the whole request, waiting for a slot included). Both run on the event loop thread.
"""
from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from service.errors import IncompleteGeneration, ServiceError, TooManyRequests

QUEUE_FACTOR = 2  # waiting requests per in-flight slot (the reference server's QUEUE_REQUESTS_NUM_MULTI)


class Admission:
    """Slots for requests in flight, plus a bounded FIFO of requests waiting for one."""

    def __init__(self, max_in_flight: int, max_waiting: int | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.max_waiting = QUEUE_FACTOR * max_in_flight if max_waiting is None else max_waiting
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)  # only undecided waiters stay in the line

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.waiting == 0

    async def acquire(self, timeout: float | None = None) -> None:
        """Take a slot, waiting in line if none is free; 429 when the line is full too.

        ``timeout`` (seconds) bounds the wait: then ``IncompleteGeneration`` (the request's e2eTimeout).
        """
        if self.in_flight < self.max_in_flight and not self.waiting:
            self.in_flight += 1
            return
        if self.waiting >= self.max_waiting:
            raise TooManyRequests(f"the server is busy: {self.in_flight} requests in flight (maxLinkNum "
                                  f"{self.max_in_flight}) and {self.waiting} waiting; retry later")
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            await asyncio.wait_for(asyncio.shield(granted), timeout)
        except asyncio.TimeoutError:
            self._leave(granted)
            raise IncompleteGeneration(f"waited {timeout:g} s for a free slot (e2eTimeout) without getting "
                                       "one") from None
        except BaseException:
            self._leave(granted)
            raise

    def release(self) -> None:
        """Give the slot back: it passes straight to the first waiter, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands; in_flight stays the same
                return
        self.in_flight -= 1

    def reject_waiting(self, error: ServiceError) -> None:
        """Every request still waiting for a slot fails with ``error`` (shutdown)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def _leave(self, granted: asyncio.Future[None]) -> None:
        """A waiter gives up: drop it from the line, or hand back the slot it got meanwhile."""
        if granted.done() and not granted.cancelled() and granted.exception() is None:
            self.release()
        else:
            granted.cancel()
            try:
                self._waiters.remove(granted)
            except ValueError:
                pass


class Deadlines:
    """When a request must have its next token (``tokenTimeout``) and its end (``e2eTimeout``)."""

    def __init__(self, token_timeout: float, e2e_timeout: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.token_timeout = token_timeout
        self.e2e_timeout = e2e_timeout
        self._clock = clock
        self.started = self._last_token = clock()
        self.tokens = 0

    def token(self) -> None:
        self.tokens += 1
        self._last_token = self._clock()

    def e2e_left(self) -> float:
        return self.started + self.e2e_timeout - self._clock()

    def left(self) -> float:
        """Seconds until the nearer deadline (<= 0: already past)."""
        return min(self._last_token + self.token_timeout, self.started + self.e2e_timeout) - self._clock()

    def expired(self) -> IncompleteGeneration:
        """The error for the deadline that passed first."""
        token_due = self._last_token + self.token_timeout
        if token_due <= self.started + self.e2e_timeout:
            which = "the first token" if self.tokens == 0 else f"token {self.tokens + 1}"
            return IncompleteGeneration(f"timed out: no {which} within tokenTimeout ({self.token_timeout:g} s); "
                                        f"{self.tokens} tokens generated")
        return IncompleteGeneration(f"timed out: the request took longer than e2eTimeout ({self.e2e_timeout:g} s); "
                                    f"{self.tokens} tokens generated")
