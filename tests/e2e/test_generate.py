"""POST / end to end on a real socket with the real default model: the example request of docs/api.md and README.md,
text and SSE bodies against the response schemas, every parameter's observable effect, the server options
(tokenIdFormat, fullTextEnabled), errors, client disconnects, and the greedy goldens."""
from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from backends.types import GenerationResult
from service.config import ServerSettings
from tests.support.golden import (
    EOS_PROMPT,
    GREEDY_TEXT,
    LOGPROB_TOL,
    NUMPY_GOLDEN,
    PROMPT,
    PROMPT_IDS,
    assert_same,
)
from tests.support.http import (
    TIMEOUT,
    error_json,
    event_ids,
    joined_text,
    ok_json,
    parse_sse,
    post,
    request,
    stream_events,
    wait_idle,
)
from tests.support.paths import GOLDEN_DIR

REGENERATE = os.environ.get("MINDSERVE_REGENERATE_GOLDENS") == "1"
SEED_DOC_EXAMPLE: dict[str, Any] = {  # the example request body of docs/api.md, verbatim
    "inputs": "My name is Olivier and I",
    "parameters": {
        "decoder_input_details": True,
        "details": True,
        "do_sample": True,
        "max_new_tokens": 20,
        "repetition_penalty": 1.03,
        "return_full_text": False,
        "seed": None,
        "temperature": 0.5,
        "top_k": 10,
        "top_p": 0.95,
        "truncate": None,
        "typical_p": 0.5,
        "watermark": False,
        "stop": ["stop1", "stop2"],
        "adapter_id": "None",
    },
    "stream": False,
}


# --- docs/api.md's example request --------------------------------------------------------------------

def test_seed_doc_example_text(server_url: str) -> None:
    result = ok_json(post(server_url, SEED_DOC_EXAMPLE))
    details = result["details"]
    assert details["prompt_tokens"] == len(PROMPT_IDS)
    assert [t["id"] for t in details["prefill"]] == PROMPT_IDS
    assert details["prefill"][0]["logprob"] is None
    assert all(isinstance(t["logprob"], float) and t["logprob"] <= 0 for t in details["prefill"][1:])
    assert "".join(t["text"] for t in details["prefill"]) == PROMPT
    assert all(t["special"] is False for t in details["prefill"])
    assert details["generated_tokens"] == len(details["tokens"]) > 0
    for token in details["tokens"]:
        assert isinstance(token["logprob"], float) and token["logprob"] <= 0, token
        assert isinstance(token["special"], bool) and isinstance(token["text"], str), token
    assert details["finish_reason"] in ("length", "eos_token", "stop_sequence")
    if details["finish_reason"] == "length":
        assert details["generated_tokens"] == 20
    assert isinstance(details["seed"], int) and 1 <= details["seed"] <= 2**64 - 1
    assert "stop1" not in result["generated_text"] and "stop2" not in result["generated_text"]


def test_seed_doc_example_with_stream_is_rejected_before_the_stream(server_url: str) -> None:
    reply = post(server_url, {**SEED_DOC_EXAMPLE, "stream": True})
    message = error_json(reply, 422, "Input Validation Error")
    assert "decoder_input_details" in message and "stream" in message


def test_seed_doc_example_stream_matches_text(server_url: str) -> None:
    parameters = {**SEED_DOC_EXAMPLE["parameters"], "decoder_input_details": False, "seed": 789070824}
    events = stream_events(post(server_url, {**SEED_DOC_EXAMPLE, "parameters": parameters, "stream": True}))
    text = ok_json(post(server_url, {**SEED_DOC_EXAMPLE, "parameters": {**parameters,
                                                                         "decoder_input_details": True}}))
    last = events[-1]
    assert last["generated_text"] == text["generated_text"] == joined_text(events)
    assert event_ids(events) == [t["id"] for t in text["details"]["tokens"]]
    for event, token in zip(events, text["details"]["tokens"]):
        assert math.isclose(event["token"]["logprob"], token["logprob"], abs_tol=LOGPROB_TOL)
    assert last["details"] == {"prompt_tokens": 8, "finish_reason": text["details"]["finish_reason"],
                               "generated_tokens": len(events), "seed": 789070824}


# --- server options -------------------------------------------------------------------------------

def test_stream_details_only_when_asked(server_url: str) -> None:
    events = stream_events(post(server_url, request(stream=True, max_new_tokens=4, do_sample=False)))
    assert len(events) == 4 and events[-1]["details"] is None
    assert events[-1]["generated_text"] == joined_text(events) == "'m here to help"


def test_full_text_enabled_events_grow(server_url_full_text: str) -> None:
    events = stream_events(post(server_url_full_text, request(stream=True, max_new_tokens=10, do_sample=False)))
    texts = [e["token"]["text"] for e in events]
    assert all(len(later) > len(earlier) and later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert texts[-1] == events[-1]["generated_text"] == "'m here to help you with your business. I"
    assert event_ids(events) == NUMPY_GOLDEN["generated_ids"][:10]


def test_token_id_format_int(server_url_int_ids: str) -> None:
    events = stream_events(post(server_url_int_ids, request(stream=True, max_new_tokens=10, do_sample=False,
                                                            details=True)))
    assert [e["token"]["id"] for e in events] == NUMPY_GOLDEN["generated_ids"][:10]
    assert all(type(e["token"]["id"]) is int for e in events)
    assert events[-1]["generated_text"] == joined_text(events) == "'m here to help you with your business. I"
    assert events[-1]["details"]["generated_tokens"] == 10


# --- parameters -----------------------------------------------------------------------------------

def test_return_full_text_prepends_inputs(server_url: str) -> None:
    result = ok_json(post(server_url, request(max_new_tokens=5, do_sample=False, return_full_text=True)))
    assert result["generated_text"] == PROMPT + "'m here to help you"
    events = stream_events(post(server_url, request(stream=True, max_new_tokens=5, do_sample=False,
                                                    return_full_text=True)))
    assert events[-1]["generated_text"] == PROMPT + "'m here to help you"
    assert joined_text(events) == "'m here to help you"  # token texts stay the generated ones


@pytest.mark.parametrize("truncate, kept", [(3, PROMPT_IDS[-3:]), (1, PROMPT_IDS[-1:]), (8, PROMPT_IDS),
                                            (1000, PROMPT_IDS)])
def test_truncate_keeps_the_last_tokens(server_url: str, truncate: int, kept: list[int]) -> None:
    result = ok_json(post(server_url, request(max_new_tokens=1, do_sample=False, truncate=truncate,
                                              decoder_input_details=True)))
    assert result["details"]["prompt_tokens"] == len(kept)
    assert [t["id"] for t in result["details"]["prefill"]] == kept
    assert result["details"]["prefill"][0]["logprob"] is None


def test_truncate_changes_what_the_model_sees(server_url: str) -> None:
    """truncate=3 answers exactly as a request whose inputs are those 3 tokens ("ier and I")."""
    cut = ok_json(post(server_url, request(max_new_tokens=5, do_sample=False, truncate=3, details=True)))
    tail = ok_json(post(server_url, request("ier and I", max_new_tokens=5, do_sample=False,
                                            decoder_input_details=True)))
    assert [t["id"] for t in tail["details"]["prefill"]] == PROMPT_IDS[-3:]
    assert cut["generated_text"] == tail["generated_text"]
    assert [t["id"] for t in cut["details"]["tokens"]] == [t["id"] for t in tail["details"]["tokens"]]


@pytest.mark.parametrize("stop, expected", [
    ("business", "'m here to help you with your "),  # a whole word
    ("elp y", "'m here to h"),  # across a token boundary
    ([" go-to", "'ll"], "'m here to help you with your business. I"),  # the first to match wins
])
def test_stop_sequence_cuts_before_it(server_url: str, stop: Any, expected: str) -> None:
    assert GREEDY_TEXT.startswith(expected)
    result = ok_json(post(server_url, request(max_new_tokens=20, do_sample=False, stop=stop, details=True)))
    assert result["generated_text"] == expected
    assert result["details"]["finish_reason"] == "stop_sequence"
    assert result["details"]["generated_tokens"] < 20
    events = stream_events(post(server_url, request(stream=True, max_new_tokens=20, do_sample=False, stop=stop,
                                                    details=True)))
    assert events[-1]["generated_text"] == joined_text(events) == expected
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert event_ids(events) == [t["id"] for t in result["details"]["tokens"]]


def test_stop_not_in_output_keeps_length(server_url: str) -> None:
    result = ok_json(post(server_url, request(max_new_tokens=10, do_sample=False, stop=["zebra", "stop1"],
                                              details=True)))
    assert result["generated_text"] == "'m here to help you with your business. I"
    assert result["details"]["finish_reason"] == "length"


def test_finish_reason_length(server_url: str) -> None:
    details = ok_json(post(server_url, request(max_new_tokens=3, do_sample=False, details=True)))["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == len(details["tokens"]) == 3
    assert [t["id"] for t in details["tokens"]] == NUMPY_GOLDEN["generated_ids"][:3]


def test_finish_reason_eos_token(server_url: str) -> None:
    result = ok_json(post(server_url, request(EOS_PROMPT, max_new_tokens=30, do_sample=False, details=True)))
    details = result["details"]
    assert details["finish_reason"] == "eos_token"
    assert details["generated_tokens"] == len(details["tokens"]) < 30
    assert details["tokens"][-1]["special"] is True
    assert details["tokens"][-1]["text"] not in result["generated_text"]
    events = stream_events(post(server_url, request(EOS_PROMPT, stream=True, max_new_tokens=30, do_sample=False,
                                                    details=True)))
    assert events[-1]["token"]["special"] is True
    assert events[-1]["generated_text"] == joined_text(events) == result["generated_text"]
    assert events[-1]["details"]["finish_reason"] == "eos_token"


def test_max_new_tokens_capped_by_max_iter_times(server_url: str, default_engine: Any) -> None:
    assert default_engine.config.max_iter_times == 64
    result = ok_json(post(server_url, request(max_new_tokens=1000, do_sample=False, details=True)))
    assert result["details"]["finish_reason"] == "length"
    assert result["details"]["generated_tokens"] == len(result["details"]["tokens"]) == 64
    assert result["generated_text"].startswith(GREEDY_TEXT)


@pytest.mark.parametrize("parameters, has_details, has_prefill", [
    ({}, False, False),
    ({"details": False, "decoder_input_details": False}, False, False),
    ({"details": True}, True, False),
    ({"decoder_input_details": True}, True, True),
    ({"details": True, "decoder_input_details": True}, True, True),
])
def test_details_only_when_asked(server_url: str, parameters: dict[str, Any], has_details: bool,
                                 has_prefill: bool) -> None:
    result = ok_json(post(server_url, request(max_new_tokens=2, do_sample=False, **parameters)))
    assert ("details" in result) is has_details
    if has_details:
        assert (result["details"]["prefill"] != []) is has_prefill
        assert len(result["details"]["prefill"]) == (8 if has_prefill else 0)


def test_seed_is_reported(server_url: str) -> None:
    given = ok_json(post(server_url, request(max_new_tokens=2, do_sample=True, seed=424242, details=True)))
    assert given["details"]["seed"] == 424242
    drawn = [ok_json(post(server_url, request(max_new_tokens=1, do_sample=True, details=True)))["details"]["seed"]
             for _ in range(2)]
    assert all(1 <= s <= 2**64 - 1 for s in drawn) and drawn[0] != drawn[1]


def test_same_seed_same_output_different_seeds_differ(server_url: str) -> None:
    def sample(seed: int) -> tuple[str, tuple[int, ...]]:
        result = ok_json(post(server_url, request(max_new_tokens=6, do_sample=True, temperature=1.5, seed=seed,
                                                  details=True)))
        return result["generated_text"], tuple(t["id"] for t in result["details"]["tokens"])

    first = sample(7)
    assert sample(7) == first
    others = {sample(seed) for seed in (8, 9)}
    assert any(other != first for other in others)


def test_same_seed_same_output_while_batched(server_url: str) -> None:
    """A seeded request's output does not depend on what else is in the batch (docs/api.md, `seed`)."""
    body = request(max_new_tokens=8, do_sample=True, temperature=1.2, seed=99, details=True)
    alone = ok_json(post(server_url, body))
    results: list[dict[str, Any]] = []
    others = [request(f"Tell me about {topic}", max_new_tokens=12, do_sample=True) for topic in ("cats", "Paris")]
    threads = [threading.Thread(target=lambda b=b: post(server_url, b)) for b in others]
    threads.append(threading.Thread(target=lambda: results.append(ok_json(post(server_url, body)))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert [t["id"] for t in results[0]["details"]["tokens"]] == [t["id"] for t in alone["details"]["tokens"]]
    assert results[0]["generated_text"] == alone["generated_text"]


def test_details_token_texts_are_the_tokens_own_text(server_url: str) -> None:
    plain = ok_json(post(server_url, request(max_new_tokens=10, do_sample=False, details=True)))
    stopped = ok_json(post(server_url, request(max_new_tokens=10, do_sample=False, details=True, stop=["stop1"])))
    assert stopped["generated_text"] == plain["generated_text"]
    assert [t["text"] for t in plain["details"]["tokens"]][7:9] == [" business", "."]
    assert [t["text"] for t in stopped["details"]["tokens"]] == [t["text"] for t in plain["details"]["tokens"]]


def test_unknown_adapter_is_rejected(server_url: str) -> None:
    reply = post(server_url, request(max_new_tokens=1, adapter_id="my-lora_v1.2/sub"))
    assert "parameters.adapter_id" in error_json(reply, 422, "Input Validation Error")


# --- multimodal-shaped inputs --------------------------------------------------------------------------

def test_text_parts_work_like_the_joined_string(server_url: str) -> None:
    parts = [{"type": "text", "text": "My name is "}, {"type": "text", "text": "Olivier and I"}]
    result = ok_json(post(server_url, {"inputs": parts, "parameters": {
        "max_new_tokens": 5, "do_sample": False, "decoder_input_details": True, "return_full_text": True}}))
    assert [t["id"] for t in result["details"]["prefill"]] == PROMPT_IDS
    assert result["generated_text"] == PROMPT + "'m here to help you"


@pytest.mark.parametrize("kind, value", [
    ("image_url", "/data/multimodal_inputs/cat.png"),
    ("image_url", {"url": "https://example.com/cat.png"}),
    ("video_url", "/data/multimodal_inputs/clip.mp4"),
    ("audio_url", "/data/multimodal_inputs/voice.wav"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_media_part_on_text_model_is_rejected(server_url: str, kind: str, value: Any, stream: bool) -> None:
    body = {"inputs": [{"type": "text", "text": "Describe this"}, {"type": kind, kind: value}], "stream": stream}
    message = error_json(post(server_url, body), 422, "Input Validation Error")
    assert "inputs[1]" in message and kind in message


# --- errors -------------------------------------------------------------------------------------------

def test_unknown_path_is_404(server_url: str) -> None:
    message = error_json(post(server_url, request(), path="/nope"), 404, "NotFoundError")
    assert "/nope" in message
    error_json(requests.get(server_url + "/v2/nothing", timeout=TIMEOUT), 404, "NotFoundError")


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
def test_wrong_method_is_405_with_allow(server_url: str, method: str) -> None:
    reply = requests.request(method, server_url + "/", timeout=TIMEOUT)
    assert method in error_json(reply, 405, "Method Not Allowed")
    assert reply.headers["Allow"] == "GET, HEAD, POST"  # RFC 9110: the methods / is served with


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b'{"inputs": "x", "parameters": {"temperature": NaN}}',
                                 b"\xff\xfe"])
def test_non_json_body_is_400(server_url: str, raw: bytes) -> None:
    reply = post(server_url, None, data=raw, headers={"Content-Type": "application/json"})
    assert "JSON" in error_json(reply, 400, "Bad Request")


def test_body_over_max_request_length_is_413(live_servers: Any, default_engine: Any) -> None:
    url = live_servers.start(default_engine, replace(ServerSettings(), max_request_bytes=1024))
    message = error_json(post(url, request("word " * 400)), 413, "Payload Too Large")
    assert "1024" in message
    assert ok_json(post(url, request(max_new_tokens=1, do_sample=False)))["generated_text"] == "'m"


@pytest.mark.parametrize("stream", [False, True])
def test_too_long_prompt_names_limit_and_count(server_url: str, default_engine: Any, stream: bool) -> None:
    prompt = " ".join(f"word{i % 50}" for i in range(300))
    count = default_engine.count_tokens(prompt)
    assert count > 200
    message = error_json(post(server_url, request(prompt, stream=stream, max_new_tokens=2)), 422,
                         "Input Validation Error")
    assert str(count) in message and "200" in message


def test_prompt_at_the_limit_is_accepted(server_url: str, default_engine: Any) -> None:
    prompt = " a" * 200  # one token each
    assert default_engine.count_tokens(prompt) == 200
    details = ok_json(post(server_url, request(prompt, max_new_tokens=1, details=True)))["details"]
    assert details["prompt_tokens"] == 200
    error_json(post(server_url, request(prompt + " a", max_new_tokens=1)), 422, "Input Validation Error")


# --- client disconnect ------------------------------------------------------------------------------

class _Recorder:
    """Wraps the engine's submit to see each request's final event (how far it got before cancel)."""

    def __init__(self, engine: Any) -> None:
        self._submit = engine.submit
        self.tokens = 0
        self.result: Any = None
        self.done = threading.Event()

    def submit(self, inputs: str, params: Any, listener: Any = None) -> Any:
        def spy(event: Any) -> None:
            if isinstance(event, GenerationResult) or isinstance(event, Exception):
                self.result = event
                self.done.set()
            else:
                self.tokens += 1
            listener(event)

        return self._submit(inputs, params, spy)


def _open_post(url: str, body: dict[str, Any]) -> socket.socket:
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (parts.netloc.encode(), len(data)) + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_request(server_url: str, default_engine: Any, monkeypatch: Any,
                                        stream: bool) -> None:
    wait_idle(default_engine, 30)
    recorder = _Recorder(default_engine)
    monkeypatch.setattr(default_engine, "submit", recorder.submit)
    sock = _open_post(server_url, request(stream=stream, max_new_tokens=60, do_sample=False))
    started = time.perf_counter()
    if stream:
        received = b""
        while received.count(b"data: ") < 3:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert b"text/event-stream" in received
    else:
        while recorder.tokens < 3:
            assert time.perf_counter() - started < TIMEOUT
            time.sleep(0.002)
    per_token = (time.perf_counter() - started) / 3  # an upper bound: includes the prefill
    sock.close()
    closed = time.perf_counter()
    freed_in = wait_idle(default_engine, 5)
    assert recorder.done.wait(5)
    assert freed_in < 2.0, freed_in
    assert isinstance(recorder.result, GenerationResult), recorder.result
    assert recorder.result.finish_reason.value == "stop_sequence"  # cancelled
    assert recorder.result.generated_tokens < 60
    assert recorder.tokens == recorder.result.generated_tokens
    print(f"stream={stream}: cancelled after {recorder.result.generated_tokens} tokens, freed "
          f"{time.perf_counter() - closed:.3f}s after close (~{per_token * 1000:.0f} ms/token before)")
    assert ok_json(post(server_url, request(max_new_tokens=1, do_sample=False)))["generated_text"] == "'m"


# --- goldens ------------------------------------------------------------------------------------------

GOLDEN_BODY = {"inputs": PROMPT, "parameters": {"max_new_tokens": 20, "do_sample": False, "details": True,
                                                  "seed": 1234}}


def _check_or_regenerate(path: Path, text: str) -> str:
    if REGENERATE:
        path.write_text(text, encoding="utf-8")
        pytest.skip(f"regenerated {path.name}")
    assert path.exists(), f"{path} is missing: run with MINDSERVE_REGENERATE_GOLDENS=1"
    return path.read_text(encoding="utf-8")


def test_golden_greedy_response(server_url: str) -> None:
    reply = post(server_url, GOLDEN_BODY)
    live = ok_json(reply)
    assert [t["id"] for t in live["details"]["tokens"]] == NUMPY_GOLDEN["generated_ids"]
    golden_text = _check_or_regenerate(GOLDEN_DIR / "post_greedy_response.json", reply.content.decode("utf-8"))
    golden = json.loads(golden_text)
    assert [t["id"] for t in golden[0]["details"]["tokens"]] == NUMPY_GOLDEN["generated_ids"]
    assert golden[0]["generated_text"] == NUMPY_GOLDEN["generated_text"]
    assert golden[0]["details"]["seed"] == 1234
    assert golden[0]["details"]["finish_reason"] == "length"
    assert golden[0]["details"]["generated_tokens"] == 20 and golden[0]["details"]["prompt_tokens"] == 8
    assert_same(reply.json(), golden)


def test_golden_greedy_stream(server_url: str) -> None:
    reply = post(server_url, {**GOLDEN_BODY, "stream": True})
    events = stream_events(reply)
    assert event_ids(events) == NUMPY_GOLDEN["generated_ids"]
    golden_text = _check_or_regenerate(GOLDEN_DIR / "post_greedy_stream.sse", reply.content.decode("utf-8"))
    golden = parse_sse(golden_text)
    assert event_ids(golden) == NUMPY_GOLDEN["generated_ids"]
    assert golden[-1]["generated_text"] == NUMPY_GOLDEN["generated_text"]
    assert golden[-1]["details"] == {"prompt_tokens": 8, "finish_reason": "length", "generated_tokens": 20,
                                     "seed": 1234}
    assert_same(events, golden)


def test_goldens_agree() -> None:
    """The text golden's tokens are the stream golden's events (ids, texts, logprobs)."""
    response = json.loads((GOLDEN_DIR / "post_greedy_response.json").read_text(encoding="utf-8"))
    stream = parse_sse((GOLDEN_DIR / "post_greedy_stream.sse").read_text(encoding="utf-8"))
    tokens = response[0]["details"]["tokens"]
    assert_same([{"id": [t["id"]], "text": t["text"], "logprob": t["logprob"], "special": t["special"]}
                 for t in tokens], [e["token"] for e in stream])
