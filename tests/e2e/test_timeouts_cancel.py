"""tokenTimeout / e2eTimeout, client disconnects and engine faults, seen through HTTP.

Handler-level cases use the fake backend; the engine cases run a real tiny-model Engine whose runner
is slowed down, stalled or made to fail for one request (monkeypatched), and check that the engine
gives every batch slot and cache block back (``Engine.info()`` and ``/info``).
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from backends.mindspore.engine.engine import Engine
from backends.settings import EngineConfig
from service.admission import Admission
from service.config import ServerSettings
from tests.support.fake_backend import FakeBackend, GatedBackend, Pace
from tests.support.http import until

TIMEOUT = 60
ENGINE_CONFIG = EngineConfig(max_seq_len=128, max_input_tokens=64, max_batch_size=16, max_iter_times=100,
                             block_size=16, prefill_chunk=16, max_prefill_batch=4, window_buckets=(128,),
                             batch_buckets=(1, 16))
PROMPT = "the quick brown fox jumps over the lazy dog"
# Engine steps (decode calls) a request may still see once it timed out or its client left: a few (it is cancelled
# then, and the engine drops it at its next step; measured: 0); a cancel that is missed lets it run its ~70-90 other
# tokens, one step each.
STEPS_AFTER_CANCEL = 20


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine(tiny_model_dir, ENGINE_CONFIG) as eng:
        yield eng


def idle(engine: Engine) -> bool:
    info = engine.info()
    return info["running"] == 0 and info["waiting"] == 0 and info["free_blocks"] == info["total_blocks"]


def wait_idle(engine: Engine, seconds: float) -> float:
    """Seconds until the engine holds no request, slot or cache block (fails after ``seconds``)."""
    started = time.monotonic()
    while not idle(engine):
        assert time.monotonic() - started < seconds, engine.info()
        time.sleep(0.005)
    return time.monotonic() - started


class SlowDecode:
    """Wraps ``runner.decode``: each call sleeps ``delay`` s; from call ``stall_after`` on, ``stall`` s."""

    def __init__(self, decode: Any, delay: float = 0.0, stall_after: int | None = None, stall: float = 0.0):
        self.decode, self.delay, self.stall_after, self.stall = decode, delay, stall_after, stall
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        stalled = self.stall_after is not None and self.calls > self.stall_after
        time.sleep(self.stall if stalled else self.delay)
        return self.decode(*args, **kwargs)


@pytest.fixture
def slow(engine, monkeypatch):
    """``slow(delay=..., stall_after=..., stall=...)`` slows the engine's decode for this test."""
    wait_idle(engine, 30)

    def install(**kwargs: Any) -> SlowDecode:
        wrapper = SlowDecode(engine.runner.decode, **kwargs)
        monkeypatch.setattr(engine.runner, "decode", wrapper)
        return wrapper

    return install


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def gen_body(stream: bool = False, max_new_tokens: int = 40) -> dict:
    return {"inputs": PROMPT, "stream": stream, "parameters": {"max_new_tokens": max_new_tokens, "do_sample": False}}


# --- timeouts, handler level (fake backend) -------------------------------------------------------

# The stalls are long (a request the timeout misses ends after 10 s or more) and cost nothing when the timeout
# works: the fake backend stops stalling once the request is cancelled. tokenTimeout is 1 s where it must not
# fire between two tokens 10 ms apart, however busy the machine.
@pytest.mark.parametrize("pace, settings, fragment", [
    (Pace(tokens=5, first_delay=10.0), {"token_timeout": 0.2}, "no the first token within tokenTimeout (0.2 s)"),
    (Pace(tokens=5, delay=0.01, stall_after=2, stall=10.0), {"token_timeout": 1.0}, "no token 3 within tokenTimeout"),
    (Pace(tokens=100, delay=0.1), {"e2e_timeout": 0.3}, "longer than e2eTimeout (0.3 s)"),
])
def test_timeout_non_stream_is_500_and_cancels(live_servers, pace, settings, fragment):
    backend = FakeBackend(pace)
    url = live_servers.start(backend, replace(ServerSettings(), **settings))
    started = time.monotonic()
    reply = requests.post(url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 100}},
                          timeout=TIMEOUT)
    assert time.monotonic() - started < 3.0  # timed out: 0.2 to 1 s; missed: 10 s
    assert reply.status_code == 500 and set(reply.json()) == {"error", "error_type"}
    assert reply.json()["error_type"] == "Incomplete Generation" and fragment in reply.json()["error"], reply.json()
    assert backend.cancelled() == [True]


def test_token_timeout_mid_stream_ends_with_an_error_event(live_servers):
    backend = FakeBackend(Pace(tokens=10, delay=0.01, stall_after=4, stall=10.0))
    url = live_servers.start(backend, replace(ServerSettings(), token_timeout=1.0))
    reply = requests.post(url + "/generate_stream", json={"inputs": "x"}, timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(reply.text)
    assert [e["token"]["id"] for e in events[:-1]] == [[0], [1], [2], [3]]  # each token goes out as it comes
    assert set(events[-1]) == {"error", "error_type"}
    assert events[-1]["error_type"] == "Incomplete Generation" and "tokenTimeout (1 s)" in events[-1]["error"]
    assert backend.cancelled() == [True]


def test_timeout_before_the_stream_opens_is_a_json_500(live_servers):
    backend = FakeBackend(Pace(tokens=3, first_delay=2.0))
    url = live_servers.start(backend, replace(ServerSettings(), token_timeout=0.2))
    reply = requests.post(url + "/", json={"inputs": "x", "stream": True}, timeout=TIMEOUT)
    assert reply.status_code == 500 and reply.json()["error_type"] == "Incomplete Generation"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_routes_time_out_too(live_servers, stream):
    backend = FakeBackend(Pace(tokens=10, delay=0.01, stall_after=3, stall=10.0))
    url = live_servers.start(backend, replace(ServerSettings(), token_timeout=1.0))
    reply = requests.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "stream": stream},
                          timeout=TIMEOUT)
    if stream:
        assert reply.status_code == 200
        error = sse_events(reply.text)[-1]["error"]
    else:
        assert reply.status_code == 500
        error = reply.json()["error"]
    assert error["type"] == "server_error" and "tokenTimeout" in error["message"]
    assert backend.cancelled() == [True]


# --- timeouts with the engine: the request is cancelled and its slot and cache freed -----------------

@pytest.mark.parametrize("stream", [False, True])
def test_token_timeout_frees_the_engine_slot_and_cache(live_servers, engine, slow, stream):
    wrapper = slow(delay=0.001, stall_after=5, stall=0.8)
    url = live_servers.start(engine, replace(ServerSettings(), token_timeout=0.3))
    reply = requests.post(url + "/", json=gen_body(stream, max_new_tokens=90), timeout=TIMEOUT)
    at_timeout = wrapper.calls
    if stream:
        assert reply.status_code == 200
        events = sse_events(reply.text)
        assert len(events) >= 3 and events[-1]["error_type"] == "Incomplete Generation"
    else:
        assert reply.status_code == 500 and "tokenTimeout (0.3 s)" in reply.json()["error"]
    wait_idle(engine, 10.0)  # the stalled step ends (<= 0.8 s), the next one drops the request
    # cancelled at the timeout: dropped at the engine's next step; not cancelled: its ~84 other tokens, a step each
    assert wrapper.calls - at_timeout <= STEPS_AFTER_CANCEL, (at_timeout, wrapper.calls)


def test_e2e_timeout_frees_the_engine_slot_and_cache(live_servers, engine, slow):
    wrapper = slow(delay=0.03)  # 90 tokens: ~3 s, so the request is mid-way at its e2eTimeout
    url = live_servers.start(engine, replace(ServerSettings(), e2e_timeout=0.5))
    reply = requests.post(url + "/generate", json=gen_body(max_new_tokens=90), timeout=TIMEOUT)
    at_timeout = wrapper.calls
    assert reply.status_code == 500 and "e2eTimeout (0.5 s)" in reply.json()["error"]
    wait_idle(engine, 10.0)
    # cancelled before the 500 went out: the engine drops it at its next step; not cancelled: ~70 more steps
    assert wrapper.calls - at_timeout <= STEPS_AFTER_CANCEL, (at_timeout, wrapper.calls)
    info = requests.get(url + "/info", timeout=TIMEOUT).json()["mindserve"]
    assert info["running"] == 0 and info["waiting"] == 0
    assert info["cache_blocks_free"] == info["cache_blocks_total"]


# --- 100 clients drop mid-stream ---------------------------------------------------------------------

async def _drop_after_first_event(host: str, port: int, body: bytes) -> tuple[bool, bool]:
    """(saw an event, saw the end) for one client that hangs up after its first ``data:`` event."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    received = b""
    while b"data: " not in received:
        chunk = await reader.read(65536)
        if not chunk:
            break
        received += chunk
    writer.transport.abort()  # drop the connection at once (RST), as a killed client would
    return b"data: " in received, b'"generated_text":"' in received


def test_hundred_clients_dropping_mid_stream_free_every_slot_and_block(live_servers, engine, slow):
    wrapper = slow(delay=0.01)  # ~100 steps per generation: well over a second each, so every client leaves mid-way
    admission = Admission(100)
    url = live_servers.start(engine, admission=admission)
    parts = urlsplit(url)
    body = json.dumps(gen_body(max_new_tokens=90)).encode()

    async def crowd() -> list[tuple[bool, bool]]:
        return await asyncio.gather(*(_drop_after_first_event(parts.hostname, parts.port, body) for _ in range(100)))

    outcomes = asyncio.run(asyncio.wait_for(crowd(), 120))
    at_drop = wrapper.calls
    assert all(saw for saw, _ in outcomes)
    assert not any(ended for _, ended in outcomes)  # every client left before its stream ended
    wait_idle(engine, 30.0)
    # the last cancels take effect within a few steps; missed, the last batch runs ~90 more steps
    assert wrapper.calls - at_drop <= STEPS_AFTER_CANCEL, (at_drop, wrapper.calls)
    info = requests.get(url + "/info", timeout=TIMEOUT).json()["mindserve"]
    assert (info["running"], info["waiting"]) == (0, 0)
    assert info["cache_blocks_free"] == info["cache_blocks_total"]
    assert until(lambda: admission.idle, 5.0)  # and the server's in-flight slots are all back
    reply = requests.post(url + "/", json=gen_body(max_new_tokens=3), timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.json()[0]["generated_text"]


def test_non_stream_disconnect_is_cancelled_within_a_few_steps(live_servers, engine, slow):
    wrapper = slow(delay=0.01)
    url = urlsplit(live_servers.start(engine))
    body = json.dumps(gen_body(max_new_tokens=90)).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 10
    while wrapper.calls < 5:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    at_close = wrapper.calls
    sock.close()
    wait_idle(engine, 10.0)
    # cancelled: the engine drops it within a few steps; not cancelled: it runs its ~85 other tokens
    assert wrapper.calls - at_close <= STEPS_AFTER_CANCEL, (at_close, wrapper.calls)


# --- one request's fault stays with it ------------------------------------------------------------

class PoisonedRunner:
    """Makes the runner fail every decode row of the requests whose prompt is ``poison``."""

    def __init__(self, engine: Engine, poison: str) -> None:
        self.engine = engine
        self.poison_ids = engine.tokenizer.encode(poison)
        self.poisoned: list[list[int]] = []  # the block tables of poisoned requests (by identity)
        self.prefill, self.decode_fn = engine.runner.prefill, engine.runner.decode

    def prefill_(self, chunks: list[Any]) -> Any:
        # With the AOT kernels decode rows come here too, as 1-token chunks of the sequence's blocks.
        if any(chunk.blocks is blocks for chunk in chunks for blocks in self.poisoned):
            raise RuntimeError("injected fault in the decode kernel")
        for chunk in chunks:  # any chunk of the poisoned prompt: when seven prompts arrive at once the step's
            # prompt budget can split it (a first chunk of 5 of its 11 tokens), and the prefix cache can start it past 0
            if chunk.start < len(self.poison_ids) and \
                    list(chunk.ids) == self.poison_ids[chunk.start:chunk.start + len(chunk.ids)]:
                if not any(chunk.blocks is blocks for blocks in self.poisoned):
                    self.poisoned.append(chunk.blocks)
        return self.prefill(chunks)

    def decode_(self, rows: list[Any]) -> Any:
        time.sleep(0.005)
        if any(row.blocks is blocks for row in rows for blocks in self.poisoned):
            raise RuntimeError("injected fault in the decode kernel")
        return self.decode_fn(rows)


@pytest.mark.parametrize("poisoned_stream", [False, True])
def test_a_fault_in_one_request_is_424_for_it_and_200_for_the_others(live_servers, engine, monkeypatch,
                                                                       poisoned_stream):
    wait_idle(engine, 30)
    url = live_servers.start(engine)
    healthy = [f"{PROMPT} {i}" for i in range(6)]
    solo = [requests.post(url + "/generate", json={"inputs": p, "parameters": {"max_new_tokens": 20,
                                                                                "do_sample": False}},
                          timeout=TIMEOUT).json()["generated_text"] for p in healthy]
    poison = PoisonedRunner(engine, "poisoned request")
    monkeypatch.setattr(engine.runner, "prefill", poison.prefill_)
    monkeypatch.setattr(engine.runner, "decode", poison.decode_)
    barrier = threading.Barrier(len(healthy) + 1)

    def post(inputs: str, stream: bool = False) -> requests.Response:
        barrier.wait()
        return requests.post(url + ("/" if stream else "/generate"),
                             json={"inputs": inputs, "stream": stream,
                                   "parameters": {"max_new_tokens": 20, "do_sample": False}}, timeout=TIMEOUT)

    with ThreadPoolExecutor(len(healthy) + 1) as pool:
        bad = pool.submit(post, "poisoned request", poisoned_stream)
        good = [pool.submit(post, p) for p in healthy]
        bad_reply, good_replies = bad.result(), [f.result() for f in good]
    if poisoned_stream and bad_reply.status_code == 200:  # the fault came after the first token went out
        error = sse_events(bad_reply.text)[-1]
    else:
        assert bad_reply.status_code == 424, bad_reply.text
        error = bad_reply.json()
    assert error == {"error": error["error"], "error_type": "Generation Error"}
    assert "injected fault" in error["error"]
    assert [r.status_code for r in good_replies] == [200] * len(healthy)
    assert [r.json()["generated_text"] for r in good_replies] == solo  # unaffected, token for token
    assert poison.poisoned, "the poisoned request never reached the runner"
    wait_idle(engine, 2.0)


@pytest.mark.parametrize("path", ["/", "/generate_stream"])
def test_the_first_token_is_streamed_before_the_next_one_exists(live_servers, path):
    """Only the final token waits (for generated_text): token 0 reaches the client while token 1 is
    still held back, so the time to first token is the backend's, not one decode step more."""
    backend = GatedBackend(Pace(tokens=3, delay=0.01), hold_at=1, cap=10.0)  # token 1 waits for the gate
    url = live_servers.start(backend)
    try:
        with requests.post(url + path, json={"inputs": "x", "stream": True}, stream=True, timeout=TIMEOUT) as reply:
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith(b"data:"))
            held = not backend.capped  # token 1 is not made yet: the gate is shut, its cap not reached
            backend.open()
            rest = [line for line in lines if line.startswith(b"data:")]
    finally:
        backend.open()
    assert json.loads(first[5:])["token"]["id"] == [0]
    assert held, "the first token arrived only once token 1 was made (after the gate's 10 s cap)"
    assert len(rest) == 2 and json.loads(rest[-1][5:])["generated_text"] == "aaa"
