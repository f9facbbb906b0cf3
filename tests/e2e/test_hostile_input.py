"""Hostile request bodies and headers: each gets a clear 4xx with the error body, never a 5xx.

Content types (a decision, see docs/reliability.md): no ``Content-Type``, ``application/json`` and
``application/*+json`` are accepted, with no charset or a UTF-8 one; any other type or charset is
415 Unsupported Media Type (as TGI answers), naming the type.
"""
from __future__ import annotations

import json
import socket
from dataclasses import replace
from urllib.parse import urlsplit

import pytest
import requests

from service.config import ServerSettings
from tests.support.fake_backend import FakeBackend

TIMEOUT = 30
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def url(live_servers):
    return live_servers.start(FakeBackend(), replace(ServerSettings(), max_request_bytes=8 << 20))


def nested(depth: int) -> bytes:
    return b'{"inputs": "x", "parameters": {"stop": ' + b"[" * depth + b"]" * depth + b"}}"


# (id, body bytes, status, error_type, words the message must contain)
BODY_CASES = [
    ("nested-65", nested(65), 400, "Bad Request", ["nested deeper than 64 levels"]),
    ("nested-100k", nested(100_000), 400, "Bad Request", ["nested deeper than 64 levels"]),
    ("nested-ok-20", nested(20), 422, "Input Validation Error", ["parameters.stop"]),
    ("huge-inputs", json.dumps({"inputs": "a" * (4 * 1024 * 1024 + 1)}).encode(), 422, "Input Validation Error",
     ["inputs", "at most"]),
    ("huge-stop-list", json.dumps({"inputs": "x", "parameters": {"stop": ["s"] * 200_000}}).encode(), 422,
     "Input Validation Error", ["parameters.stop"]),
    ("many-values", b'{"inputs": "x", "parameters": {"stop": [' + b"{}," * (1 << 21) + b"{}]}}", 400, "Bad Request",
     ["more than 2097152 values"]),
    ("many-commas-in-a-string", json.dumps({"inputs": ", " * (3 << 19)}).encode(), 200, None, []),
    ("invalid-utf8", b'{"inputs": "caf\xe9"}', 400, "Bad Request", ["UTF-8", "byte 15"]),
    ("utf8-encoded-surrogate", b'{"inputs": "\xed\xa0\x80"}', 400, "Bad Request", ["UTF-8"]),
    ("overlong-utf8", b'{"inputs": "\xc0\xaf"}', 400, "Bad Request", ["UTF-8"]),
    ("lone-surrogate-escape", b'{"inputs": "x\\ud800y"}', 400, "Bad Request", ["surrogate", "\\ud800"]),
    ("lone-surrogate-key", b'{"inputs": "x", "\\udfff": 1}', 400, "Bad Request", ["surrogate"]),
    ("nan", b'{"inputs": "x", "parameters": {"temperature": NaN}}', 400, "Bad Request", ["NaN"]),
    ("infinity", b'{"inputs": "x", "parameters": {"top_p": Infinity}}', 400, "Bad Request", ["Infinity"]),
    ("minus-infinity", b'{"inputs": "x", "parameters": {"top_p": -Infinity}}', 400, "Bad Request", ["-Infinity"]),
    ("float-overflow", b'{"inputs": "x", "parameters": {"temperature": 1e999}}', 400, "Bad Request",
     ["1e999", "out of range"]),
    ("seed-2^64", b'{"inputs": "x", "parameters": {"seed": 18446744073709551616}}', 422, "Input Validation Error",
     ["parameters.seed", "18446744073709551616"]),
    ("max-new-tokens-2^70", b'{"inputs": "x", "parameters": {"max_new_tokens": 1180591620717411303424}}', 422,
     "Input Validation Error", ["parameters.max_new_tokens"]),
    ("temperature-2^80", b'{"inputs": "x", "parameters": {"temperature": 1208925819614629174706176}}', 200, None, []),
    ("int-400-digits", b'{"inputs": "x", "parameters": {"temperature": 1' + b"0" * 400 + b"}}", 400, "Bad Request",
     ["401 digits", "out of range"]),
    ("int-5000-digits", b'{"inputs": "x", "parameters": {"seed": ' + b"9" * 5000 + b"}}", 400, "Bad Request",
     ["5000 digits"]),
    ("duplicate-top-key", b'{"inputs": "x", "inputs": "y"}', 400, "Bad Request", ['duplicate key "inputs"']),
    ("duplicate-param-key", b'{"inputs": "x", "parameters": {"seed": 1, "seed": 2}}', 400, "Bad Request",
     ['duplicate key "seed"']),
    ("empty", b"", 400, "Bad Request", ["JSON"]),
    ("bom", b'\xef\xbb\xbf{"inputs": "x"}', 400, "Bad Request", ["BOM"]),
    ("trailing-data", b'{"inputs": "x"} {}', 400, "Bad Request", ["Extra data"]),
    ("truncated", b'{"inputs": "x"', 400, "Bad Request", ["JSON"]),
    ("top-level-array", b'[{"inputs": "x"}]', 422, "Input Validation Error", ["request body"]),
    ("top-level-string", b'"inputs"', 422, "Input Validation Error", ["request body"]),
    ("top-level-null", b"null", 422, "Input Validation Error", ["request body"]),
    ("nul-in-string", b'{"inputs": "a\\u0000b"}', 200, None, []),
    ("astral-pair", b'{"inputs": "\\ud83d\\ude00"}', 200, None, []),
]


@pytest.mark.parametrize("path", ["/", "/generate"])
@pytest.mark.parametrize("name, body, status, error_type, words", BODY_CASES, ids=[c[0] for c in BODY_CASES])
def test_hostile_body(url, path, name, body, status, error_type, words):
    reply = requests.post(url + path, data=body, headers=JSON, timeout=TIMEOUT)
    assert reply.status_code == status, (reply.status_code, reply.text[:300])
    if error_type is None:
        return
    error = reply.json()
    assert set(error) == {"error", "error_type"} and error["error_type"] == error_type, error
    for word in words:
        assert word in error["error"], error["error"]
    assert len(error["error"]) < 400  # the offending value is cut, not echoed whole


@pytest.mark.parametrize("name, body, status, error_type, words",
                         [c for c in BODY_CASES if c[2] == 400], ids=[c[0] for c in BODY_CASES if c[2] == 400])
def test_hostile_body_on_the_openai_and_tokenizer_routes(url, name, body, status, error_type, words):
    reply = requests.post(url + "/v1/chat/completions", data=body, headers=JSON, timeout=TIMEOUT)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    reply = requests.post(url + "/v1/tokenizer", data=body, headers=JSON, timeout=TIMEOUT)
    assert reply.status_code == 400 and reply.json()["error_type"] == "Bad Request"


# (Content-Type sent, status, what a 415 message names)
CONTENT_TYPES = [
    (None, 200, None),
    ("application/json", 200, None),
    ("application/json; charset=utf-8", 200, None),
    ("Application/JSON;charset=UTF-8", 200, None),
    ('application/json; charset="utf-8"', 200, None),
    ("application/vnd.api+json", 200, None),
    ("text/plain", 415, "'text/plain'"),
    ("text/plain; charset=utf-8", 415, "'text/plain; charset=utf-8'"),
    ("application/x-www-form-urlencoded", 415, "'application/x-www-form-urlencoded'"),  # curl -d without -H
    ("multipart/form-data; boundary=x", 415, "'multipart/form-data; boundary=x'"),
    ("application/xml", 415, "'application/xml'"),
    ("application/json; charset=latin-1", 415, "charset 'latin-1'"),
    ("application/json; charset=utf-16", 415, "charset 'utf-16'"),
]


@pytest.mark.parametrize("content_type, status, named", CONTENT_TYPES)
def test_content_types(url, content_type, status, named):
    headers = {} if content_type is None else {"Content-Type": content_type}
    reply = requests.post(url + "/", data=b'{"inputs": "x", "parameters": {"max_new_tokens": 1}}',
                          headers=headers, timeout=TIMEOUT)
    if content_type is None:
        assert "Content-Type" not in reply.request.headers
    assert reply.status_code == status, reply.text
    if status == 415:
        error = reply.json()
        assert set(error) == {"error", "error_type"} and error["error_type"] == "Unsupported Media Type"
        assert named in error["error"], error["error"]


def test_content_type_on_openai_and_tokenizer_routes(url):
    reply = requests.post(url + "/v1/completions", data=b'{"model": "fake", "prompt": "x"}',
                          headers={"Content-Type": "text/plain"}, timeout=TIMEOUT)
    assert reply.status_code == 415 and reply.json()["error"]["type"] == "invalid_request_error"
    reply = requests.post(url + "/v1/tokenizer", data=b'{"inputs": "x"}', headers={"Content-Type": "text/plain"},
                          timeout=TIMEOUT)
    assert reply.status_code == 415 and reply.json()["error_type"] == "Unsupported Media Type"


@pytest.mark.parametrize("length", [b"-5", b"abc", b"5, 6"])
def test_bad_content_length_is_one_json_400(url, length):
    parts = urlsplit(url)
    reply = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n")
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1") == 1, reply
    assert b'"error_type":"Bad Request"' in reply and b"is not a byte count" in reply
