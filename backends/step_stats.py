"""Engine steps as histograms (``/metrics``: ``engine_step_duration_seconds``, ``engine_step_tokens``): how long
each step took and how many tokens it computed, by ``kind`` — ``decode`` (decode rows only) or ``prefill`` (a
prompt chunk in it, decode rows beside it or not). Recorded by the engine thread, read by a scrape from another:
every read takes the lock a record holds, so a snapshot's counts, sums and buckets are of the same steps."""
from __future__ import annotations

import bisect
import threading
from typing import Any

KINDS = ("decode", "prefill")
# seconds: a decode step of the default model takes ~5-30 ms on these VMs, a 16-row step of a 1.7B one ~80 ms,
# a full prompt chunk of it ~0.4 s
DURATION_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _Histogram:
    __slots__ = ("edges", "counts", "sum")

    def __init__(self, edges: tuple[float, ...]) -> None:
        self.edges, self.counts, self.sum = edges, [0] * (len(edges) + 1), 0.0  # the last count: past every edge

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1  # le: a value on an edge counts in its bucket
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        """``buckets``: (upper edge, observations <= it) for each edge, cumulative as Prometheus's; ``sum``."""
        cumulative, total = [], 0
        for edge, n in zip(self.edges, self.counts):
            total += n
            cumulative.append((edge, total))
        return {"buckets": cumulative, "count": total + self.counts[-1], "sum": self.sum}


class StepStats:
    """Each engine step's wall time and tokens, by kind, since start-up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = {kind: _Histogram(DURATION_BUCKETS) for kind in KINDS}
        self._tokens = {kind: _Histogram(TOKEN_BUCKETS) for kind in KINDS}

    def record(self, kind: str, seconds: float, tokens: int) -> None:
        with self._lock:
            self._seconds[kind].observe(seconds)
            self._tokens[kind].observe(tokens)

    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{kind: {"seconds": histogram, "tokens": histogram}}`` (``_Histogram.snapshot``'s form)."""
        with self._lock:
            return {kind: {"seconds": self._seconds[kind].snapshot(), "tokens": self._tokens[kind].snapshot()}
                    for kind in KINDS}
