"""Talking to a live server in the tests: requests, SSE parsing, the reply checks against schemas/, polling."""
from __future__ import annotations

import json
import socket
import time
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


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1 right now (the fleet launcher's ``--base-port``
    gives the replicas ports in a row: the ones after a free port are checked too, not assumed)."""
    for _ in range(100):
        sockets = [socket.socket()]
        try:
            sockets[0].bind(("127.0.0.1", 0))
            base = sockets[0].getsockname()[1]
            for port in range(base + 1, base + n):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found on 127.0.0.1")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (for a server process told its ports up front)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
