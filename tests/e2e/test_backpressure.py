"""Bounded load: maxLinkNum in flight, 2 × maxLinkNum waiting, then 429; bodies over maxRequestLength
→ 413 without being read whole; 503 while draining. Handler-level, over real sockets, with a fake backend."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from urllib.parse import urlsplit

import pytest
import requests

from service.admission import Admission, Deadlines
from service.config import ServerSettings
from service.errors import IncompleteGeneration, ServiceUnavailable, TooManyRequests
from service.state import ServerState
from tests.support.fake_backend import FakeBackend, GatedBackend, Pace
from tests.support.http import until

TIMEOUT = 30
BODY = {"inputs": "hello", "parameters": {"max_new_tokens": 5}}


def error_of(reply: requests.Response, status: int, error_type: str) -> str:
    assert reply.status_code == status, (reply.status_code, reply.text)
    body = reply.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    return body["error"]


# --- Admission and Deadlines (pure) ----------------------------------------------------------------

def test_admission_in_flight_then_queue_then_429_first_come_first_served():
    async def scenario():
        gate = Admission(2)  # 2 in flight, 4 waiting
        assert gate.max_waiting == 4
        await gate.acquire()
        await gate.acquire()
        order: list[int] = []

        async def waiter(i: int) -> None:
            await gate.acquire()
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(4)]
        await asyncio.sleep(0)
        assert (gate.in_flight, gate.waiting) == (2, 4)
        with pytest.raises(TooManyRequests, match="maxLinkNum 2"):
            await gate.acquire()
        for _ in range(4):
            gate.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3] and (gate.in_flight, gate.waiting) == (2, 0)
        gate.release()
        gate.release()
        assert gate.idle

    asyncio.run(scenario())


def test_admission_wait_is_bounded_and_a_leaver_gives_its_place_back():
    async def scenario():
        gate = Admission(1, max_waiting=2)
        await gate.acquire()
        with pytest.raises(IncompleteGeneration, match="e2eTimeout"):
            await gate.acquire(timeout=0.05)
        assert gate.waiting == 0
        task = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.waiting == 0
        gate.release()
        assert gate.idle

    asyncio.run(scenario())


def test_admission_reject_waiting_fails_the_queue_only():
    async def scenario():
        gate = Admission(1)
        await gate.acquire()
        tasks = [asyncio.create_task(gate.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        gate.reject_waiting(ServiceUnavailable("shutting down"))
        for task in tasks:
            with pytest.raises(ServiceUnavailable):
                await task
        assert (gate.in_flight, gate.waiting) == (1, 0)

    asyncio.run(scenario())


def test_deadlines_pick_the_nearer_limit_and_name_it():
    now = [100.0]
    d = Deadlines(token_timeout=2.0, e2e_timeout=5.0, clock=lambda: now[0])
    assert d.left() == 2.0
    now[0] = 101.5
    d.token()
    assert d.left() == 2.0  # tokenTimeout counts again from the last token
    now[0] = 103.6
    assert d.left() == pytest.approx(-0.1)
    assert "token 2" in d.expired().message and "tokenTimeout (2 s)" in d.expired().message
    d.token()
    now[0] = 105.0
    assert d.left() == 0.0  # e2e (100 + 5) comes before the next token deadline (103.6 + 2)
    assert "e2eTimeout (5 s)" in d.expired().message
    fresh = Deadlines(1.0, 10.0, clock=lambda: 0.0)
    assert "the first token" in fresh.expired().message


# --- 429 over HTTP ------------------------------------------------------------------------------------

def _post(url: str, path: str, body: dict) -> tuple[float, requests.Response]:
    """(seconds it took, reply) of one POST."""
    started = time.monotonic()
    reply = requests.post(url + path, json=body, timeout=TIMEOUT)
    return time.monotonic() - started, reply


def _slots(url: str) -> tuple[int, int]:
    """(requests in flight, requests waiting for a slot), from /info."""
    gauges = requests.get(url + "/info", headers={"Connection": "close"}, timeout=TIMEOUT).json()["mindserve"]["http"]
    return gauges["slots_in_use"], gauges["waiting_for_slot"]


def _wait_for_slots(url: str, in_flight: int, waiting: int) -> None:
    """Until ``in_flight`` requests hold a slot and ``waiting`` wait for one (the gate keeps them there)."""
    assert until(lambda: _slots(url) == (in_flight, waiting), TIMEOUT), _slots(url)


@pytest.mark.parametrize("path, body", [("/", BODY), ("/generate_stream", BODY),
                                        ("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 5})])
def test_one_in_flight_two_waiting_then_429(live_servers, path, body):
    backend = GatedBackend(Pace(tokens=5))  # nothing ends before the gate opens
    url = live_servers.start(backend, replace(ServerSettings(), max_link_num=1))
    with ThreadPoolExecutor(3) as pool:
        try:
            held = [pool.submit(_post, url, path, body) for _ in range(3)]
            _wait_for_slots(url, in_flight=1, waiting=2)
            for _ in range(2):
                took, reply = _post(url, path, body)
                assert took < 5, took  # refused at once, not after a wait (a wait would last until the gate opens)
                if path.startswith("/v1/"):
                    assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"
                else:
                    assert "maxLinkNum 1" in error_of(reply, 429, "Too Many Requests")
            assert _slots(url) == (1, 2) and len(backend.handles) <= 1  # the refused ones changed nothing
        finally:
            backend.open()
        assert [f.result()[1].status_code for f in held] == [200, 200, 200]
    assert len(backend.handles) == 3  # the refused ones never reached the backend
    assert backend.capped == 0
    assert requests.post(url + path, json=body, timeout=TIMEOUT).status_code == 200  # room again


def test_in_flight_limit_is_shared_by_all_generation_routes(live_servers):
    backend = GatedBackend(Pace(tokens=5))
    url = live_servers.start(backend, replace(ServerSettings(), max_link_num=1))
    chat = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
    with ThreadPoolExecutor(3) as pool:
        try:
            held = [pool.submit(_post, url, path, body)
                    for path, body in [("/generate", BODY), ("/v1/chat/completions", chat), ("/", BODY)]]
            _wait_for_slots(url, in_flight=1, waiting=2)
            assert _post(url, "/generate_stream", BODY)[1].status_code == 429
        finally:
            backend.open()
        assert [f.result()[1].status_code for f in held] == [200, 200, 200]
    assert requests.post(url + "/v1/tokenizer", json={"inputs": "a b"}, timeout=TIMEOUT).status_code == 200


def test_queue_wait_counts_against_e2e_timeout(live_servers):
    backend = GatedBackend(Pace(tokens=10))  # the gate stays shut: the request in flight never gets a token
    url = live_servers.start(backend, replace(ServerSettings(), max_link_num=1, e2e_timeout=1.0))
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_post, url, "/", BODY)
        _wait_for_slots(url, in_flight=1, waiting=0)
        took, second = _post(url, "/", BODY)  # waits for the slot the first holds until its e2eTimeout
        first_reply = first.result()[1]
    assert "e2eTimeout (1 s)" in error_of(first_reply, 500, "Incomplete Generation")
    message = error_of(second, 500, "Incomplete Generation")
    assert "e2eTimeout (1 s)" in message or "for a free slot (e2eTimeout)" in message, message
    # waiting counted: ~1 s in all; not counted: ~2 s (about 1 s for the slot, then 1 s in flight)
    assert took < 1.6, took


def test_draining_server_answers_503_to_new_generation_requests(live_servers):
    state = ServerState(ready=True)
    url = live_servers.start(FakeBackend(), state=state)
    assert requests.post(url + "/", json=BODY, timeout=TIMEOUT).status_code == 200
    state.start_draining()
    session = requests.Session()
    for path in ("/", "/generate", "/generate_stream"):
        assert "shutting down" in error_of(session.post(url + path, json=BODY, timeout=TIMEOUT), 503,
                                           "Service Unavailable")
    reply = session.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=TIMEOUT)
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable_error"
    assert requests.get(url + "/health", timeout=TIMEOUT).status_code == 503


# --- 413 ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_body_url(live_servers):
    """maxRequestLength of 1 KiB."""
    return live_servers.start(FakeBackend(), replace(ServerSettings(), max_request_bytes=1024))


def _raw_exchange(url: str, head: bytes, body: bytes) -> tuple[bytes, bool]:
    """Send ``head`` + ``body`` on a raw socket, read until the server closes; (reply, reset seen)."""
    parts = urlsplit(url)
    reply, reset = b"", False
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        try:
            sock.sendall(head + body)
        except (BrokenPipeError, ConnectionResetError):
            reset = True  # the server stopped reading: what matters is that its answer arrives
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            reset = True
    return reply, reset


def test_declared_length_over_the_limit_is_413_before_the_body_is_read(small_body_url):
    head = (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n")
    reply, _ = _raw_exchange(small_body_url, head, b"x" * 100_000)  # 100 kB of a declared 50 MB
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"error_type":"Payload Too Large"' in rest and b"50000000 bytes" in rest
    assert reply.count(b"HTTP/1.1") == 1  # no second (tornado 400) answer after ours


def test_chunked_body_over_the_limit_is_413_as_it_streams(small_body_url):
    chunk = b"200\r\n" + b"y" * 0x200 + b"\r\n"  # 512-byte chunks; the third passes 1 KiB
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    reply, _ = _raw_exchange(small_body_url, head, chunk * 6)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"more than 1024 bytes" in reply and reply.count(b"HTTP/1.1") == 1


def test_chunked_body_within_the_limit_is_served(small_body_url):
    data = b'{"inputs": "hello", "parameters": {"max_new_tokens": 2}}'
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    reply, reset = _raw_exchange(small_body_url, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
    assert reply.startswith(b"HTTP/1.1 200") and b'"generated_text":"aa"' in reply and not reset


@pytest.mark.parametrize("path", ["/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                                  "/v1/tokenizer"])
def test_big_body_from_a_normal_client_gets_413(small_body_url, path):
    reply = requests.post(small_body_url + path, data=b" " * (8 << 20), timeout=TIMEOUT,
                          headers={"Content-Type": "application/json"})
    assert reply.status_code == 413
    message = reply.json()["error"]
    assert "1024 bytes" in (message["message"] if isinstance(message, dict) else message)
    # the next request on a fresh connection is served as usual
    ok = requests.post(small_body_url + "/", json=BODY, timeout=TIMEOUT)
    assert ok.status_code == 200


def test_refusals_decided_before_the_body_keep_the_connection(live_servers):
    """A 429 or 415 is sent after the body is read (and dropped), so the connection stays usable."""
    backend = GatedBackend(Pace(tokens=20))  # the three busy requests hold the slot and the line until the end
    url = live_servers.start(backend, replace(ServerSettings(), max_link_num=1))
    parts = urlsplit(url)
    long_body = {"inputs": "x", "parameters": {"max_new_tokens": 20}}
    with ThreadPoolExecutor(3) as pool:
        try:
            busy = [pool.submit(requests.post, url + "/", json=long_body, timeout=TIMEOUT) for _ in range(3)]
            _wait_for_slots(url, in_flight=1, waiting=2)
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
            for content_type, status in [("application/json", 429), ("text/plain", 415), ("application/json", 429)]:
                conn.request("POST", "/", body=json.dumps(BODY), headers={"Content-Type": content_type})
                reply = conn.getresponse()
                assert reply.status == status and set(json.loads(reply.read())) == {"error", "error_type"}
                assert reply.getheader("Connection") != "close"
            conn.close()
        finally:
            backend.open()
        assert all(f.result().status_code == 200 for f in busy)
    assert requests.post(url + "/", json=BODY, timeout=TIMEOUT).status_code == 200
