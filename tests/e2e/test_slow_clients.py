"""Slow and hostile clients on real sockets (127.0.0.1): a request takes a generation slot only once its body
is in; heads, bodies and idle keep-alive connections are timed out; 431 over maxHeaderBytes; every outcome is
in the access log and the gauges. Each test bounds its own waits and closes its own sockets."""
from __future__ import annotations

import json
import logging
import resource
import socket
import subprocess
import time
from contextlib import ExitStack
from dataclasses import replace
from urllib.parse import urlsplit

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from service.config import ServerSettings
from service.connections import bind
from tests.support.fake_backend import FakeBackend, Pace
from tests.support.http import until

TIMEOUT = 30
BODY = json.dumps({"inputs": "hello", "parameters": {"max_new_tokens": 3}}).encode()
CLOSE = {"Connection": "close"}  # no keep-alive connection left behind to count
SHORT = replace(ServerSettings(), header_timeout=0.6, body_timeout=0.6, keep_alive_timeout=0.6)


def head(path: str = "/", length: int | None = None, extra: bytes = b"") -> bytes:
    cl = b"" if length is None else b"Content-Length: %d\r\n" % length
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s%s\r\n" % (path.encode(), cl, extra)


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
    return sock


def read_response(sock: socket.socket, seconds: float = 10.0) -> tuple[int | None, dict, float]:
    """(status, JSON body or {}, seconds waited) of the one response on ``sock`` (status None: closed
    without one)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, socket.timeout):
        raise AssertionError(f"no end of response within {seconds} s: {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    waited = time.monotonic() - start
    if not data:
        return None, {}, waited
    status = int(data.split(b" ", 2)[1])
    body = data.partition(b"\r\n\r\n")[2]
    return status, (json.loads(body) if body.startswith(b"{") else {}), waited


def info(url: str) -> dict:
    return requests.get(url + "/info", headers=CLOSE, timeout=TIMEOUT).json()["mindserve"]["http"]


def metric(url: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` (besides model_name) in ``/metrics``."""
    text = requests.get(url + "/metrics", headers=CLOSE, timeout=TIMEOUT).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and {k: v for k, v in sample.labels.items() if k != "model_name"} == labels:
                return sample.value
    raise AssertionError(f"{name} {labels} not exported")


@pytest.fixture(scope="module", autouse=True)
def enough_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- admission after the body --------------------------------------------------------------------------

def test_slow_body_flood_does_not_block_generation(live_servers):
    """The shipped maxLinkNum (300) of sockets that sent their head and trickle the body hold no slot:
    a normal request meanwhile is answered at once, and the gauges say where everyone is."""
    settings = replace(ServerSettings(), max_link_num=300)
    url = live_servers.start(FakeBackend(Pace(tokens=3)), settings)
    with ExitStack() as stack:
        flood = [stack.enter_context(connect(url)) for _ in range(300)]
        for sock in flood:
            sock.sendall(head(length=1000) + b"{")
        assert until(lambda: info(url)["reading_body"] == 300, 10), info(url)
        started = time.monotonic()
        reply = requests.post(url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}},
                              headers=CLOSE, timeout=TIMEOUT)
        took = time.monotonic() - started
        assert reply.status_code == 200 and reply.json()[0]["generated_text"]
        assert took < 5, took  # before the fix it waited for the attackers (25 s, or its own timeout)
        gauges = info(url)
        assert gauges["reading_body"] == 300 and gauges["slots_in_use"] == 0 and gauges["waiting_for_slot"] == 0
        assert gauges["open_connections"] >= 300
        assert metric(url, "http_requests_reading_body") == 300
    assert until(lambda: info(url)["reading_body"] == 0, 5)  # gone clients stop counting at once
    assert until(lambda: info(url)["open_connections"] == 1, 5), info(url)["open_connections"]  # this /info


def test_a_full_reading_bound_is_answered_429_at_once(live_servers):
    url = live_servers.start(FakeBackend(), replace(ServerSettings(), max_reading_requests=4))
    with ExitStack() as stack:
        for _ in range(4):
            stack.enter_context(connect(url)).sendall(head(length=100) + b"{")
        assert until(lambda: info(url)["reading_body"] == 4, 5)
        sock = stack.enter_context(connect(url))
        sock.sendall(head(length=len(BODY)))
        status, body, waited = read_response(sock)
        assert status == 429 and body["error_type"] == "Too Many Requests", body
        assert "maxReadingRequests 4" in body["error"] and waited < 5
    assert until(lambda: info(url)["reading_body"] == 0, 5)
    reply = requests.post(url + "/", data=BODY, timeout=TIMEOUT)  # the readers gone, requests pass again
    assert reply.status_code == 200


def test_bodies_being_read_hold_at_most_max_buffered_body_bytes(live_servers):
    settings = replace(ServerSettings(), max_request_bytes=1024, max_buffered_body_bytes=2048)
    url = live_servers.start(FakeBackend(), settings)
    before = metric(url, "http_refused_total", reason="buffered_full")
    with ExitStack() as stack:
        for _ in range(2):  # two uploads of 1024 bytes, not yet complete, held whole from their heads on
            stack.enter_context(connect(url)).sendall(head(length=1024) + b"{" + b" " * 999)
        assert until(lambda: metric(url, "http_body_bytes_buffered") == 2048, 5)
        sock = stack.enter_context(connect(url))
        sock.sendall(head(length=100) + b"{" + b" " * 99)
        status, body, _ = read_response(sock)
        assert status == 503 and "maxBufferedBodyMB" in body["error"], body
    assert metric(url, "http_refused_total", reason="buffered_full") == before + 1
    assert until(lambda: metric(url, "http_body_bytes_buffered") == 0, 5)


def test_a_refused_request_never_takes_a_slot(live_servers):
    """A 422 is decided on the body before admission: with one slot held, a bad body still gets its 422."""
    backend = FakeBackend(Pace(tokens=200, delay=0.05))
    url = live_servers.start(backend, replace(ServerSettings(), max_link_num=1))
    with ExitStack() as stack:
        holder = stack.enter_context(requests.post(url + "/", json={"inputs": "x", "stream": True,
                                                                  "parameters": {"max_new_tokens": 200}},
                                                   stream=True, timeout=TIMEOUT))
        assert holder.status_code == 200 and until(lambda: info(url)["slots_in_use"] == 1, 5)
        bad = requests.post(url + "/", json={"inputs": "x", "parameters": {"top_p": 1.0}}, timeout=TIMEOUT)
        assert bad.status_code == 422 and "parameters.top_p" in bad.json()["error"]


# --- timeouts on what the client controls ------------------------------------------------------------------

def test_a_slow_head_gets_408_at_header_timeout(live_servers):
    url = live_servers.start(FakeBackend(), SHORT)
    before = metric(url, "http_timeouts_total", kind="header")
    started = time.monotonic()  # before connect: the server's header clock starts when it accepts
    with connect(url) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
        status, body, _ = read_response(sock, 10)
        waited = time.monotonic() - started
    assert status == 408 and body["error_type"] == "Request Timeout" and "headerTimeout" in body["error"], body
    assert 0.5 < waited < 5
    with connect(url) as sock:  # a connection that sends nothing at all
        status, _, waited = read_response(sock, 10)
    assert status is None and waited < 5
    assert metric(url, "http_timeouts_total", kind="header") == before + 2


def test_a_trickling_body_gets_408_at_body_timeout(live_servers, caplog):
    caplog.set_level(logging.INFO, logger="mindserve.access")
    url = live_servers.start(FakeBackend(), SHORT)
    before = metric(url, "http_timeouts_total", kind="body")
    with connect(url) as sock:
        sock.sendall(head(length=100, extra=b"X-Request-Id: trickle-1\r\n") + b'{"in')
        status, body, waited = read_response(sock, 10)
    assert status == 408 and "bodyTimeout (0.6 s)" in body["error"] and "4 bytes arrived" in body["error"], body
    assert waited < 5
    with connect(url) as sock:  # a chunked body that never ends
        sock.sendall(head(extra=b"Transfer-Encoding: chunked\r\n") + b"2\r\n{\"\r\n")
        status, body, _ = read_response(sock, 10)
    assert status == 408
    assert metric(url, "http_timeouts_total", kind="body") == before + 2
    assert until(lambda: any("request_id=trickle-1" in r.getMessage() and "status=408" in r.getMessage()
                             for r in caplog.records), 2)
    assert info(url)["reading_body"] == 0


def test_an_idle_keep_alive_connection_is_closed(live_servers):
    url = live_servers.start(FakeBackend(), SHORT)
    before = metric(url, "http_timeouts_total", kind="keepalive")
    with connect(url) as sock:
        sock.sendall(head(length=len(BODY)) + BODY)
        sock.settimeout(10)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        started = time.monotonic()
        rest = b""
        while chunk := sock.recv(65536):  # the server closes the idle connection: recv returns b""
            rest += chunk
        assert time.monotonic() - started < 5
    assert metric(url, "http_timeouts_total", kind="keepalive") == before + 1


# --- 431 -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("what, extra", [
    ("one 1 MB header line", b"X-Big: " + b"a" * (1 << 20) + b"\r\n"),
    ("230 KB of headers", b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range(2300))),
])
def test_an_oversized_head_gets_431(live_servers, what, extra):
    url = live_servers.start(FakeBackend())
    with connect(url) as sock:
        sock.sendall(head(length=len(BODY), extra=extra) + BODY)
        status, body, _ = read_response(sock, 10)
    assert status == 431, what
    assert body["error_type"] == "Request Header Fields Too Large" and "maxHeaderBytes (65536" in body["error"]
    reply = requests.post(url + "/", data=BODY, timeout=TIMEOUT)  # and the server is fine
    assert reply.status_code == 200


def test_a_body_over_the_cap_keeps_its_413(live_servers):
    url = live_servers.start(FakeBackend(), replace(ServerSettings(), max_request_bytes=1024))
    reply = requests.post(url + "/", data=b"{" + b" " * 2000 + b"}", timeout=TIMEOUT)
    assert reply.status_code == 413 and reply.json()["error_type"] == "Payload Too Large"


# --- accounting ---------------------------------------------------------------------------------------------

def test_a_client_gone_mid_stream_is_logged_499_with_its_tokens(live_servers, caplog):
    caplog.set_level(logging.INFO, logger="mindserve.access")
    url = live_servers.start(FakeBackend(Pace(tokens=500, delay=0.02)))
    with connect(url) as sock:
        body = json.dumps({"inputs": "x", "stream": True, "parameters": {"max_new_tokens": 500}}).encode()
        sock.sendall(head(length=len(body), extra=b"X-Request-Id: gone-1\r\n") + body)
        sock.settimeout(10)
        got = b""
        while got.count(b"data:") < 3:
            got += sock.recv(65536)
    def line() -> str | None:
        return next((r.getMessage() for r in caplog.records if "request_id=gone-1" in r.getMessage()), None)
    assert until(lambda: line() is not None, 5)
    fields = dict(pair.split("=", 1) for pair in line().split(" "))
    assert fields["status"] == "499" and int(fields["generated_tokens"]) >= 3, line()


def test_a_client_gone_while_sending_its_body_is_logged_499(live_servers, caplog):
    caplog.set_level(logging.INFO, logger="mindserve.access")
    url = live_servers.start(FakeBackend())
    with connect(url) as sock:
        sock.sendall(head(length=100, extra=b"X-Request-Id: gone-2\r\n") + b"{")
        assert until(lambda: info(url)["reading_body"] == 1, 5)
    assert until(lambda: any("request_id=gone-2" in r.getMessage() and "status=499" in r.getMessage()
                             for r in caplog.records), 5)
    assert until(lambda: info(url)["reading_body"] == 0, 2)


def test_the_listen_backlog_is_the_configured_one():
    sockets = bind(0, "127.0.0.1", replace(ServerSettings(), listen_backlog=77))
    try:
        port = sockets[0].getsockname()[1]
        try:
            out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                                 timeout=10).stdout
        except FileNotFoundError:
            pytest.skip("ss (iproute2) is not installed")
        assert out.split()[2] == "77", out  # a listening socket's Send-Q is its backlog
    finally:
        for sock in sockets:
            sock.close()
