"""Fuzz: over 10,000 generated requests against a live server on the tiny model, over a real socket.

Bodies range from valid-ish (every field drawn from plausible values or from arbitrary JSON) to
hostile (mangled JSON text, random bytes, deep nesting, NaN, duplicate keys, invalid UTF-8). Every
answer must be < 500; every error must have exactly the route's error shape (``{"error",
"error_type"}`` on the TGI routes and /v1/tokenizer, OpenAI's ``{"error": {...}}`` on /v1/*); no
stream may end in an error event; nothing may be logged as an uncaught exception; the server must be
healthy afterwards. Examples are derandomized, so every run sends the same requests.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import replace

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.mindspore.engine.engine import Engine
from backends.settings import EngineConfig
from service.admission import Admission
from service.config import ServerSettings
from service.errors import ErrorType, for_status

# Every generation is capped at 2 tokens by the engine (maxIterTimes), whatever max_new_tokens says.
FUZZ_ENGINE = EngineConfig(max_seq_len=64, max_input_tokens=48, max_batch_size=4, max_iter_times=2, block_size=16,
                           prefill_chunk=16, window_buckets=(64,), batch_buckets=(1, 4))
TGI_PATHS = ("/", "/generate", "/generate_stream")
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
ALL_PATHS = (*TGI_PATHS, *OPENAI_PATHS, "/v1/tokenizer")
# examples per test, and requests per example: 1500 + 3 × 1000 + 2 × 1200 + 2 × 1200 + 1000 = 10,300 requests
EXAMPLES = {"valid": 1500, "tgi": 1000, "openai": 1200, "mangled": 1200, "raw": 1000}
MIN_REQUESTS = 10_000
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
sent: Counter[str] = Counter()  # requests per test, checked by the last test
statuses: Counter[int] = Counter()


class ErrorLog(logging.Handler):
    """Collects ERROR records of Tornado and asyncio: uncaught exceptions inside the server."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model_dir):
    with Engine(tiny_model_dir, FUZZ_ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(live_servers, fuzz_engine):
    errors = ErrorLog()
    loggers = [logging.getLogger(name) for name in ("tornado.application", "tornado.general", "asyncio")]
    for logger in loggers:
        logger.addHandler(errors)
    admission = Admission(ServerSettings().max_link_num)
    url = live_servers.start(fuzz_engine, replace(ServerSettings(), max_request_bytes=256 * 1024),
                             admission=admission)
    with requests.Session() as session:
        yield url, session, errors, admission
    for logger in loggers:
        logger.removeHandler(errors)


def send(server, test: str, path: str, data: bytes, content_type: str | None = "application/json") -> None:
    url, session, _, _ = server
    headers = {"Content-Type": content_type} if content_type else {}
    reply = session.post(url + path, data=data, headers=headers, timeout=60)
    sent[test] += 1
    statuses[reply.status_code] += 1
    assert reply.status_code < 500, (path, data[:300], reply.status_code, reply.text[:500])
    if reply.status_code >= 400:
        check_error(path, reply)
    elif reply.headers.get("Content-Type", "").startswith("text/event-stream"):
        for line in reply.text.split("\n"):  # SSE lines end at LF only (the text may hold U+0085, U+2028)
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), (path, data[:300], line)


def check_error(path: str, reply: requests.Response) -> None:
    body = reply.json()
    if path in OPENAI_PATHS:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        return
    assert set(body) == {"error", "error_type"}, body
    assert isinstance(body["error"], str) and body["error"]
    assert body["error_type"] == for_status(reply.status_code, "").error_type.value, (reply.status_code, body)
    assert body["error_type"] in {t.value for t in ErrorType}


# --- strategies -------------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-3, 3) | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=5)
small_text = st.text(max_size=24)
unit = st.floats(-0.5, 1.5, allow_nan=False)
PLAUSIBLE_PARAMS = {
    "max_new_tokens": st.integers(-1, 3) | st.sampled_from([2**31 - 1, 2**31, 2**63, 2**64]),
    "temperature": st.floats(-1, 3, allow_nan=False) | st.sampled_from([0, 1e-7, 1e-6, 1e30]),
    "top_k": st.integers(-1, 600) | st.sampled_from([2**31 - 1, 2**31]),
    "top_p": unit | st.sampled_from([1e-6, 1.0, 0.999999]),
    "typical_p": unit,
    "repetition_penalty": st.floats(-1, 3, allow_nan=False),
    "seed": st.integers(-1, 3) | st.sampled_from([2**64 - 1, 2**64]),
    "truncate": st.integers(-1, 70),
    "stop": small_text | st.lists(small_text, max_size=4),
    "do_sample": st.booleans(),
    "details": st.booleans(),
    "decoder_input_details": st.booleans(),
    "return_full_text": st.booleans(),
    "watermark": st.booleans(),
    "adapter_id": st.sampled_from(["None", "nope", "a" * 257, ""]),
    "best_of": st.sampled_from([None, 1, 2]),
    "top_n_tokens": st.sampled_from([None, 0, 5]),
    "frequency_penalty": st.sampled_from([None, 0, 0.5]),
    "grammar": st.sampled_from([None, {"type": "json", "value": {}}]),
}
param_value = {key: value | json_values for key, value in PLAUSIBLE_PARAMS.items()}
VALID_PARAMS = {
    "max_new_tokens": st.integers(1, 2), "temperature": st.floats(0.01, 2.0), "top_k": st.integers(1, 500),
    "top_p": st.floats(0.01, 0.99), "typical_p": st.floats(0.01, 1.0), "repetition_penalty": st.floats(0.5, 2.0),
    "seed": st.integers(1, 2**64 - 1), "truncate": st.integers(1, 60),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3), "do_sample": st.booleans(),
    "details": st.booleans(), "return_full_text": st.booleans(), "watermark": st.booleans(),
}
valid_body = st.fixed_dictionaries({"inputs": st.text(min_size=1, max_size=40),
                                    "parameters": st.fixed_dictionaries({}, optional=VALID_PARAMS)},
                                   optional={"stream": st.booleans()})
parameters = (st.fixed_dictionaries({}, optional={**param_value, "unknown_key": json_values})
              | st.dictionaries(st.text(max_size=10), json_values, max_size=4) | json_values)
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "bogus"])},
                                       optional={"text": small_text | json_values,
                                                 "image_url": st.text(max_size=30) | json_values}), max_size=3)
inputs = small_text | small_text.map(lambda t: t * 20) | parts | json_values
tgi_body = st.fixed_dictionaries({}, optional={"inputs": inputs, "parameters": parameters,
                                               "stream": st.booleans() | json_values, "extra": json_values})
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
                                          optional={"content": small_text | json_values}), max_size=3)
openai_body = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "other"]) | json_values, "prompt": small_text | json_values,
    "messages": messages | json_values, "max_tokens": st.integers(-1, 3) | json_values,
    "temperature": st.floats(-1, 3, allow_nan=False) | json_values, "top_p": unit | json_values,
    "stream": st.booleans() | json_values, "stop": small_text | json_values, "n": st.integers(0, 3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "logprobs": json_values, "seed": st.integers(-1, 2**64) | json_values, "extra": json_values})


def mangle(text: str, how: str, where: int) -> bytes:
    """Break a JSON document in one of several ways at position ``where``."""
    cut = where % (len(text) + 1)
    if how == "truncate":
        return text[:cut].encode()
    if how == "nan":
        return text.replace(":", ": NaN,", 1).encode() if ":" in text else b"NaN"
    if how == "duplicate":
        if text.startswith("{") and len(text) > 2:
            return (text[:-1] + ', "inputs": "again"}').encode()
        return text.encode()
    if how == "deep":
        depth = 40 + where % 200
        return ('{"inputs": "x", "parameters": ' + "[" * depth + "]" * depth + "}").encode()
    if how == "bad_utf8":
        raw = text.encode()
        return raw[:cut] + b"\xff\xc3(" + raw[cut:]
    if how == "surrogate":
        return (text[:cut] + '"\\udc80"' + text[cut:]).encode()
    if how == "big_int":
        return text.replace(":", ": 1" + "0" * (300 + where % 4700) + ",", 1).encode()
    if how == "control_chars":
        return (text[:cut] + "\x00\x07\n" + text[cut:]).encode()
    return text.encode()


MANGLINGS = ["truncate", "nan", "duplicate", "deep", "bad_utf8", "surrogate", "big_int", "control_chars", "none"]


# --- the fuzz tests ---------------------------------------------------------------------------------------

@settings(FUZZ, max_examples=EXAMPLES["valid"])
@given(body=valid_body, path=st.sampled_from(TGI_PATHS))
def test_fuzz_valid_tgi_bodies(server, body, path):
    send(server, "valid", path, json.dumps(body).encode())


@settings(FUZZ, max_examples=EXAMPLES["tgi"])
@given(body=tgi_body)
def test_fuzz_hostile_tgi_bodies(server, body):
    data = json.dumps(body).encode()
    for path in TGI_PATHS:
        send(server, "tgi", path, data)


@settings(FUZZ, max_examples=EXAMPLES["openai"])
@given(body=openai_body)
def test_fuzz_openai_bodies(server, body):
    data = json.dumps(body).encode()
    for path in OPENAI_PATHS:
        send(server, "openai", path, data)


@settings(FUZZ, max_examples=EXAMPLES["mangled"])
@given(body=tgi_body | openai_body, how=st.sampled_from(MANGLINGS), where=st.integers(0, 10_000),
       paths=st.lists(st.sampled_from(ALL_PATHS), min_size=2, max_size=2, unique=True))
def test_fuzz_mangled_json(server, body, how, where, paths):
    data = mangle(json.dumps(body), how, where)
    for path in paths:
        send(server, "mangled", path, data)


@settings(FUZZ, max_examples=EXAMPLES["raw"])
@given(data=st.binary(max_size=300), path=st.sampled_from(ALL_PATHS),
       content_type=st.sampled_from([None, "application/json", "text/plain", "application/json; charset=latin-1",
                                     "application/octet-stream"]))
def test_fuzz_random_bytes_and_content_types(server, data, path, content_type):
    send(server, "raw", path, data, content_type)


def test_server_is_healthy_after_the_fuzz(server, fuzz_engine):
    url, session, errors, admission = server
    assert [r.getMessage() for r in errors.records] == []  # no uncaught exception inside the server
    assert (admission.in_flight, admission.waiting) == (0, 0)  # every request gave its slot back
    assert session.get(url + "/health", timeout=10).status_code == 200
    reply = session.post(url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert reply.status_code == 200 and reply.json()[0]["generated_text"] is not None
    info = fuzz_engine.info()
    assert (info["running"], info["waiting"], info["free_blocks"]) == (0, 0, info["total_blocks"])
    if set(sent) == set(EXAMPLES):  # the whole module ran (not a -k selection)
        assert sum(sent.values()) >= MIN_REQUESTS, sent
        assert statuses[200] > 500, statuses  # some requests were valid and generated
    print(f"fuzz: {sum(sent.values())} requests {dict(sent)}; statuses {dict(sorted(statuses.items()))}")
