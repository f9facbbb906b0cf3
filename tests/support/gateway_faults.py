"""Faults under load through the real SMG, for tests/e2e/test_fleet_faults.py (loopback) and
test_fleet_netns.py (each replica in its own network namespace): the load (client threads sending streamed and
plain /v1/completions back to back, each outcome recorded), SMG's view of its workers (/workers, its Prometheus
series), and the fleet's members restarted in place. The assertions live in the test modules."""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field

import requests

# SMG's resilience settings for a fleet: probe /health every second (1 s timeout), out after 2 failures, back
# after 1 success; the circuit breaker opens after 3 failed requests and tries again after 2 s; a request
# refused by a replica (connection refused, a draining replica's 503) is sent again, to another, up to 3 times.
RESILIENCE = ("--health-check-interval-secs", "1", "--health-check-timeout-secs", "1",
              "--health-failure-threshold", "2", "--health-success-threshold", "1",
              "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "2",
              "--retry-max-retries", "3", "--retry-initial-backoff-ms", "50")
# The longest SMG may take to stop routing to a stalled replica with RESILIENCE: a probe starts within 1 s,
# times out after 1 s, two in a row.
EJECTION_WINDOW = 1 + 2 * (1 + 1)
REQUEST_TIMEOUT = 90  # s: a client gives up (a hang) after this


@dataclass
class Outcome:
    client: int
    started: float
    ended: float
    stream: bool
    ok: bool
    status: int | None = None
    error: str = ""           # "" when ok
    error_event: bool = False  # a stream that ended with an SSE error event (a clear end, not a cut)


def one_request(session: requests.Session, url: str, model: str, client: int, n: int,
                max_tokens: int) -> Outcome:
    stream = (client + n) % 2 == 0
    body = {"model": model, "prompt": f"Client {client} asks question {n}:", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    started = time.monotonic()
    try:
        reply = session.post(url + "/v1/completions", json=body, stream=stream, timeout=REQUEST_TIMEOUT)
        if reply.status_code != 200:
            return Outcome(client, started, time.monotonic(), stream, False, reply.status_code,
                           reply.text[:200])
        if not stream:
            ok = reply.json()["choices"][0]["finish_reason"] in ("length", "stop")
            return Outcome(client, started, time.monotonic(), stream, ok, 200, "" if ok else reply.text[:200])
        events, done = [], False
        for line in reply.iter_lines():
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
        errors = [e for e in events if "error" in e]
        finished = any((e.get("choices") or [{}])[0].get("finish_reason") for e in events)
        ok = done and finished and not errors
        error = "" if ok else (json.dumps(errors[0])[:200] if errors else f"cut: done={done} events={len(events)}")
        return Outcome(client, started, time.monotonic(), stream, ok, 200, error, bool(errors))
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        return Outcome(client, started, time.monotonic(), stream, False, None, repr(exc)[:200])


@dataclass
class Load:
    """``clients`` threads sending requests to ``url`` back to back until ``stop()``."""

    url: str
    model: str
    clients: int = 6
    max_tokens: int = 12
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()

    def _client(self, i: int) -> None:
        with requests.Session() as session:
            n = 0
            while not self._stop.is_set():
                self.outcomes.append(one_request(session, self.url, self.model, i, n, self.max_tokens))
                n += 1

    def stop(self) -> bool:
        """Stop sending; True if every client's last request ended within the request timeout (no hang)."""
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT + 10)
        return not any(t.is_alive() for t in self._threads)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def describe(self, outcomes: list[Outcome]) -> str:
        return "\n".join(f"{o.started - self.t0:.2f}-{o.ended - self.t0:.2f} s client {o.client} stream {o.stream} "
                         f"status {o.status}: {o.error}" for o in outcomes[:10])


class Smg:
    """What SMG says of its workers: /workers on its port, its Prometheus series on ``metrics_url``."""

    def __init__(self, url: str, metrics_url: str) -> None:
        self.url, self.metrics_url = url, metrics_url

    def workers(self) -> dict[str, dict]:
        """Worker URL → its /workers entry (``is_healthy``, ``status``)."""
        try:
            listing = requests.get(self.url + "/workers", timeout=5).json()
        except (requests.RequestException, ValueError):
            return {}
        return {w["url"].rstrip("/"): w for w in listing.get("workers", [])}

    def routable(self, worker: str) -> bool:
        entry = self.workers().get(worker.rstrip("/"))
        return bool(entry and entry.get("is_healthy"))

    def series(self, name: str) -> dict[str, float]:
        """``name{worker="URL",...} value`` → {URL: value} (summed over the other labels)."""
        try:
            text = requests.get(self.metrics_url + "/metrics", timeout=5).text
        except requests.RequestException:
            return {}
        out: dict[str, float] = {}
        for m in re.finditer(rf'^{re.escape(name)}\{{[^}}]*worker="([^"]+)"[^}}]*\}} (\S+)$', text, re.M):
            out[m.group(1).rstrip("/")] = out.get(m.group(1).rstrip("/"), 0.0) + float(m.group(2))
        return out

    def sent_to(self, worker: str) -> float:
        """Requests SMG has dispatched to ``worker`` (smg_worker_requests_total, counted at each send)."""
        return self.series("smg_worker_requests_total").get(worker.rstrip("/"), 0.0)

    def retries(self) -> float:
        try:
            text = requests.get(self.metrics_url + "/metrics", timeout=5).text
        except requests.RequestException:
            return 0.0
        return sum(float(v) for v in re.findall(r"^smg_worker_retries_total\{[^}]*\} (\S+)$", text, re.M))


def first_time(predicate, seconds: float, poll: float = 0.05) -> float | None:
    """The monotonic time ``predicate`` was first seen true, polling for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(poll)
    return None


def running(replica_url: str) -> float:
    """The replica's own count of requests in its running batch (its /metrics), 0 if it does not answer."""
    try:
        text = requests.get(replica_url + "/metrics", timeout=2).text
    except requests.RequestException:
        return 0.0
    return sum(float(v) for v in re.findall(r"^num_requests_running\{[^}]*\} (\S+)$", text, re.M))
