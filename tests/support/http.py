"""Talking to a live server in the tests: requests, SSE parsing, the reply checks against schemas/, polling."""
from __future__ import annotations

import itertools
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from service.validation import default_schemas
from tests.support.golden import PROMPT

TIMEOUT = 120  # seconds per HTTP call; the machine may be busy


def post(url: str, body: Any, *, path: str = "/", **kwargs: Any) -> requests.Response:
    """POST a JSON value (or raw ``data=``) to the live server."""
    if "data" not in kwargs:
        kwargs["json"] = body
    return requests.post(url + path, timeout=TIMEOUT, **kwargs)


def request(prompt: str = PROMPT, stream: bool = False, **parameters: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": prompt, "parameters": parameters}
    if stream:
        body["stream"] = True
    return body


def parse_sse(text: str) -> list[dict[str, Any]]:
    """The JSON of each event of an SSE body, checking the framing: only ``data: <json>\\n\\n`` events."""
    assert text.endswith("\n\n"), repr(text[-200:])
    events = []
    for chunk in text[:-2].split("\n\n"):
        assert chunk.startswith("data: ") and "\n" not in chunk, repr(chunk[:200])
        payload = chunk[len("data: "):]
        assert payload != "[DONE]"
        events.append(json.loads(payload))
    return events


def stream_events(reply: requests.Response) -> list[dict[str, Any]]:
    """A stream reply's events, each checked against stream_event.schema.json and the last-event rules."""
    assert reply.status_code == 200, reply.text
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(reply.content.decode("utf-8"))
    schemas = default_schemas()
    for event in events:
        schemas.validate("stream_event", event, root="event")
        assert "error" not in event, event
    for event in events[:-1]:
        assert event["generated_text"] is None and event["details"] is None, event
    assert isinstance(events[-1]["generated_text"], str)
    return events


def ok_json(reply: requests.Response) -> dict[str, Any]:
    """The one result of a 200 non-stream reply, checked against response.schema.json."""
    assert reply.status_code == 200, reply.text
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.json()
    default_schemas().validate("response", body, root="response")
    return body[0]


def error_json(reply: requests.Response, status: int, error_type: str) -> str:
    """Check a JSON error reply against error.schema.json; return its message."""
    assert reply.status_code == status, (reply.status_code, reply.text)
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.json()
    default_schemas().validate("error", body, root="error body")
    assert body["error_type"] == error_type, body
    return body["error"]


def joined_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["token"]["text"] for e in events if not e["token"]["special"])


def event_ids(events: list[dict[str, Any]]) -> list[int]:
    ids = []
    for event in events:
        token_id = event["token"]["id"]
        assert isinstance(token_id, list) and len(token_id) == 1, token_id
        ids.append(token_id[0])
    return ids


def wait_idle(engine: Any, timeout: float) -> float:
    """Poll the engine until nothing runs or waits and every cache block is free; the seconds it took."""
    started = time.perf_counter()
    while True:
        info = engine.info()
        if info["running"] == 0 and info["waiting"] == 0 and info["free_blocks"] == info["total_blocks"]:
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout:
            raise AssertionError(f"engine still busy after {timeout}s: {info}")
        time.sleep(0.005)


def until(predicate: Any, seconds: float, poll: float = 0.005) -> bool:
    """Poll ``predicate`` until it is true (True) or ``seconds`` pass (its last value)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return bool(predicate())


# Ports handed to a server process before it binds them come from below the kernel's ephemeral range: a port of
# that range (which bind(("", 0)) hands out too) can be taken by any client connection's local end in the moment
# between the check here and the server's bind, and two pytest-xdist workers make many connections. Each worker
# takes ports from its own slice, in turn, so two workers (or two calls) never hand out the same port.
_POOL_START = 10000


def _pool() -> Iterator[int]:
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = max(1, (ephemeral - _POOL_START) // workers)
    first = _POOL_START + index * size
    offset = os.getpid() % size  # two runs at once start at different places
    return itertools.cycle([*range(first + offset, first + size), *range(first, first + offset)])


_ports = _pool()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1 right now (the fleet launcher's ``--base-port``
    gives the replicas ports in a row)."""
    for _ in range(1000):
        base = next(_ports)
        if all(_free(p) for p in range(base, base + n)):
            for _ in range(n - 1):
                next(_ports)
            return base
    raise RuntimeError(f"no {n} consecutive free ports found on 127.0.0.1")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (for a server process told its ports up front), outside
    the ephemeral range and this worker's alone."""
    ports: list[int] = []
    for _ in range(1000):
        port = next(_ports)
        if _free(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports found on 127.0.0.1")
