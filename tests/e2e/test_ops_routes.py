"""Operations and TGI routes through real sockets: health/readiness, /info, /generate, /generate_stream,
/v1/tokenizer, /v1/models, request ids and the access log, and the planes on separate ports."""
from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from importlib import metadata

import pytest
import requests
import yaml

from service.app import BUSINESS, MANAGEMENT, METRICS
from service.metrics import ServiceMetrics
from service.state import ServerState
from service.validation import default_schemas
from tests.support.cli import server_config
from tests.support.http import free_ports
from tests.support.paths import REPO

TIMEOUT = 120
PROMPT = "My name is Olivier and I"
GREEDY = {"max_new_tokens": 6, "do_sample": False, "details": True, "seed": 7}


def sse_events(reply: requests.Response) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in reply.text.split("\n\n") if line.startswith("data:")]


# --- health ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/health", "/v2/health/live", "/v2/health/ready"])
def test_health_routes_answer_200_with_an_empty_body_when_ready(server_url, path):
    reply = requests.get(server_url + path, timeout=10)
    assert reply.status_code == 200
    assert reply.content == b""


def test_health_is_503_before_ready_and_while_draining_and_live_stays_200(live_servers, default_engine):
    state = ServerState()
    url = live_servers.start(default_engine, state=state)
    for path in ("/health", "/v2/health/ready"):
        reply = requests.get(url + path, timeout=10)
        assert reply.status_code == 503
        assert reply.json()["error_type"] == "Service Unavailable"
        default_schemas().validate("error", reply.json())
    assert requests.get(url + "/v2/health/live", timeout=10).status_code == 200
    state.mark_ready()
    assert requests.get(url + "/health", timeout=10).status_code == 200
    state.start_draining()
    reply = requests.get(url + "/health", timeout=10)
    assert reply.status_code == 503 and "shutting down" in reply.json()["error"]
    assert requests.get(url + "/v2/health/ready", timeout=10).status_code == 503
    assert requests.get(url + "/v2/health/live", timeout=10).status_code == 200


GET_ROUTES = ["/health", "/v2/health/live", "/v2/health/ready", "/info", "/metrics", "/v1/models",
              "/v1/models/{model}", "/v1/models/nope", "/openapi.json"]


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_answers_like_get_without_a_body(server_url, default_engine, path):
    url = server_url + path.format(model=default_engine.model_name)
    with requests.Session() as session:  # one connection: the open-connection count stays put
        got, head = session.get(url, timeout=10), session.head(url, timeout=10)
        assert head.status_code == got.status_code
        assert head.content == b""
        assert head.headers.get("Content-Type") == got.headers.get("Content-Type")
        assert head.headers["X-Request-Id"]
        if path == "/metrics":  # a scrape's text changes between two scrapes
            return
        # /info has live figures (connections, engine steps) whose digits can change from one call to the next:
        # the HEAD's length must be that of the GETs around it, once a GET, HEAD, GET see the same figures
        lengths: list[tuple[str | None, ...]] = []
        for _ in range(20):
            before, head, after = session.get(url, timeout=10), session.head(url, timeout=10), \
                session.get(url, timeout=10)
            assert head.content == b""
            lengths.append(tuple(r.headers.get("Content-Length") for r in (before, head, after)))
            if len(set(lengths[-1])) == 1:
                break
        assert len(set(lengths[-1])) == 1 and lengths[-1][0] is not None, lengths


@pytest.mark.parametrize("path", ["/generate", "/v1/tokenizer", "/v1/completions", "/tokenize"])
def test_head_on_post_routes_is_405(server_url, path):
    reply = requests.head(server_url + path, timeout=10)
    assert reply.status_code == 405 and reply.content == b"" and reply.headers["Allow"] == "POST"


# --- /info -----------------------------------------------------------------------------------------

def test_info_has_the_reference_shape_and_our_figures(server_url, default_engine):
    reply = requests.get(server_url + "/info", timeout=10)
    assert reply.status_code == 200
    info = reply.json()
    default_schemas().validate("info", info)
    assert list(info)[:12] == ["docker_label", "max_batch_total_tokens", "max_best_of", "max_concurrent_requests",
                               "max_stop_sequences", "max_waiting_tokens", "sha", "validation_workers", "version",
                               "waiting_served_ratio", "models", "max_input_length"]
    assert info["version"] == metadata.version("mindserve")
    assert info["max_best_of"] == 1 and info["docker_label"] is None
    assert info["max_concurrent_requests"] == default_engine.config.max_batch_size
    assert info["max_batch_total_tokens"] == default_engine.config.max_prefill_tokens
    assert info["max_input_length"] == default_engine.max_prompt_tokens == 200
    assert info["max_stop_sequences"] == 1024
    assert info["models"] == [{
        "model_device_type": "cpu", "model_dtype": "float32", "model_id": default_engine.model_name,
        "model_pipeline_tag": "text-generation", "model_sha": None, "max_total_tokens": 256,
    }]
    ours = info["mindserve"]
    assert ours["ready"] is True
    assert 0 <= ours["cache_blocks_free"] <= ours["cache_blocks_total"]
    assert ours["compiled_graphs"] >= 1 and ours["running"] == 0 and ours["waiting"] == 0


# --- TGI routes ------------------------------------------------------------------------------------

def test_generate_returns_one_object_equal_to_the_element_of_post_root(server_url):
    body = {"inputs": PROMPT, "parameters": GREEDY}
    obj = requests.post(server_url + "/generate", json=body, timeout=TIMEOUT)
    listed = requests.post(server_url + "/", json=body, timeout=TIMEOUT)
    assert obj.status_code == 200 and listed.status_code == 200
    assert isinstance(obj.json(), dict)
    default_schemas().validate("response", [obj.json()])
    assert obj.json() == listed.json()[0]
    assert obj.json()["details"]["generated_tokens"] == 6


def test_generate_ignores_stream_true_in_the_body(server_url):
    reply = requests.post(server_url + "/generate", json={"inputs": PROMPT, "stream": True,
                                                          "parameters": {"max_new_tokens": 2}}, timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("application/json")
    assert set(reply.json()) == {"generated_text"}


def test_generate_stream_sends_sse_events_ending_with_the_full_text(server_url):
    body = {"inputs": PROMPT, "parameters": GREEDY}
    reply = requests.post(server_url + "/generate_stream", json=body, timeout=TIMEOUT)
    assert reply.status_code == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(reply)
    assert len(events) == 6
    for event in events:
        default_schemas().validate("stream_event", event)
    assert all(e["generated_text"] is None for e in events[:-1])
    final = events[-1]
    text = requests.post(server_url + "/generate", json=body, timeout=TIMEOUT).json()["generated_text"]
    assert final["generated_text"] == text == "".join(e["token"]["text"] for e in events)
    assert final["details"]["generated_tokens"] == 6


@pytest.mark.parametrize("path", ["/", "/generate", "/generate_stream"])
def test_tgi_routes_validate_exactly_like_post_root(server_url, path):
    body = {"inputs": PROMPT, "parameters": {"top_p": 1.0}}
    reply = requests.post(server_url + path, json=body, timeout=10)
    assert reply.status_code == 422
    assert reply.json() == {"error": "parameters.top_p must be < 1.0, got 1.0",
                            "error_type": "Input Validation Error"}


def test_generate_stream_rejects_decoder_input_details(server_url):
    body = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}
    reply = requests.post(server_url + "/generate_stream", json=body, timeout=10)
    assert reply.status_code == 422 and "decoder_input_details" in reply.json()["error"]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/v1/tokenizer"])
def test_post_only_routes_answer_405_to_get(server_url, path):
    reply = requests.get(server_url + path, timeout=10)
    assert reply.status_code == 405 and reply.json()["error_type"] == "Method Not Allowed"
    assert reply.headers["Allow"] == "POST"


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/messages"])
def test_a_405_on_a_generation_route_logs_no_traceback(server_url, path, caplog):
    """The method is refused before prepare(): the request has no observer, and finishing it must not fail."""
    for method in ("PUT", "TRACE"):  # TRACE is refused by Tornado itself (not a method it dispatches)
        assert requests.request(method, server_url + path, timeout=10).status_code == 405
    requests.get(server_url + "/health", timeout=10)  # served by the same loop after the 405's finish ran
    assert not [r for r in caplog.records if r.exc_info or "Uncaught exception" in r.getMessage()]


@pytest.mark.parametrize("method, path", [("POST", "/info"), ("DELETE", "/health"), ("PUT", "/v1/models"),
                                          ("POST", "/v1/models/x"), ("OPTIONS", "/openapi.json"),
                                          ("POST", "/metrics")])
def test_get_routes_answer_405_with_allow(server_url, method, path):
    reply = requests.request(method, server_url + path, timeout=10)
    assert reply.status_code == 405 and reply.headers["Allow"] == "GET, HEAD"


# --- /v1/tokenizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [PROMPT, "héllo wörld 你好 🙂", " leading space and\nnewline"])
def test_tokenizer_count_equals_prompt_tokens_of_a_generation(server_url, default_engine, text):
    reply = requests.post(server_url + "/v1/tokenizer", json={"inputs": text}, timeout=10)
    assert reply.status_code == 200
    body = reply.json()
    default_schemas().validate("tokenizer_response", body)
    assert body["token_number"] == len(body["tokens"])
    assert body["tokens"] == default_engine.tokenizer.encode(text)
    gen = requests.post(server_url + "/generate", json={"inputs": text, "parameters": {"max_new_tokens": 1,
                                                                                       "details": True}},
                        timeout=TIMEOUT)
    assert gen.json()["details"]["prompt_tokens"] == body["token_number"]


@pytest.mark.parametrize("body, status, fragment", [
    ({}, 422, "inputs is required"),
    ({"inputs": ""}, 422, "inputs must not be empty"),
    ({"inputs": 5}, 422, "inputs must be a string"),
    ({"inputs": "x", "extra": 1}, 422, "extra is not a known field"),
    ({"inputs": "x", "do_decode": True}, 422, "do_decode"),
    ("not json", 400, "not valid JSON"),
])
def test_tokenizer_rejects_bad_bodies(server_url, body, status, fragment):
    data = body if isinstance(body, str) else json.dumps(body)
    reply = requests.post(server_url + "/v1/tokenizer", data=data, timeout=10)
    assert reply.status_code == status
    assert fragment in reply.json()["error"]


def test_tokenizer_accepts_do_decode_false(server_url):
    reply = requests.post(server_url + "/v1/tokenizer", json={"inputs": "hi", "do_decode": False}, timeout=10)
    assert reply.status_code == 200 and reply.json()["token_number"] >= 1


# --- /v1/models ------------------------------------------------------------------------------------

def test_models_list_and_one_model(server_url, default_engine):
    reply = requests.get(server_url + "/v1/models", timeout=10)
    assert reply.status_code == 200
    listing = reply.json()
    default_schemas().validate("model_list", listing)
    assert [m["id"] for m in listing["data"]] == [default_engine.model_name]
    one = requests.get(server_url + "/v1/models/" + default_engine.model_name, timeout=10)
    assert one.status_code == 200 and one.json() == listing["data"][0]
    missing = requests.get(server_url + "/v1/models/gpt-4", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error_type"] == "NotFoundError" and "gpt-4" in missing.json()["error"]


# --- request ids and the access log ----------------------------------------------------------------

def test_request_id_is_echoed_when_valid_and_generated_otherwise(server_url):
    sent = "client-42.retry_1"
    assert requests.get(server_url + "/info", headers={"X-Request-Id": sent}, timeout=10) \
        .headers["X-Request-Id"] == sent
    seen = set()
    for bad in ("has space", "x" * 65, "semi;colon", ""):
        got = requests.get(server_url + "/info", headers={"X-Request-Id": bad}, timeout=10).headers["X-Request-Id"]
        assert got != bad and re.fullmatch(r"[A-Za-z0-9._-]{1,64}", got)
        seen.add(got)
    assert len(seen) == 4
    # errors keep the id too (write_error clears the headers)
    reply = requests.post(server_url + "/generate", data="{", headers={"X-Request-Id": sent}, timeout=10)
    assert reply.status_code == 400 and reply.headers["X-Request-Id"] == sent
    assert requests.get(server_url + "/nowhere", headers={"X-Request-Id": sent}, timeout=10) \
        .headers["X-Request-Id"] == sent


def _access_lines(caplog, request_id: str, deadline: float = 5.0) -> list[str]:
    """The access-log lines of ``request_id`` (the server logs just after the reply is sent)."""
    end = time.monotonic() + deadline
    while True:
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "mindserve.access" and f"request_id={request_id} " in r.getMessage()]
        if lines or time.monotonic() > end:
            return lines
        time.sleep(0.05)


def test_one_access_log_line_per_request_with_tokens_and_latency(server_url, caplog):
    caplog.set_level(logging.INFO, logger="mindserve.access")
    reply = requests.post(server_url + "/generate", json={"inputs": PROMPT, "parameters": GREEDY},
                          headers={"X-Request-Id": "log-test-1"}, timeout=TIMEOUT)
    details = reply.json()["details"]
    lines = _access_lines(caplog, "log-test-1")
    assert len(lines) == 1, lines
    fields = dict(pair.split("=", 1) for pair in lines[0].split(" "))
    assert fields["method"] == "POST" and fields["path"] == "/generate" and fields["status"] == "200"
    assert fields["prompt_tokens"] == str(details["prompt_tokens"])
    assert fields["generated_tokens"] == str(details["generated_tokens"])
    assert float(fields["latency_ms"]) > 0
    requests.post(server_url + "/", json={"inputs": ""}, headers={"X-Request-Id": "log-test-2"}, timeout=10)
    (line,) = _access_lines(caplog, "log-test-2")
    assert "status=422" in line and "prompt_tokens=- generated_tokens=-" in line


# --- planes on separate ports ----------------------------------------------------------------------

def test_management_and_metrics_planes_on_their_own_servers(live_servers, default_engine):
    state, metrics = ServerState(ready=True), ServiceMetrics.for_backend(default_engine)
    shared = {"state": state, "metrics": metrics}
    business = live_servers.start(default_engine, planes={BUSINESS}, **shared)
    management = live_servers.start(default_engine, planes={MANAGEMENT}, **shared)
    metrics_url = live_servers.start(default_engine, planes={METRICS}, **shared)
    for path in ("/health", "/info", "/metrics"):
        assert requests.get(business + path, timeout=10).status_code == 404, path
    assert requests.get(management + "/health", timeout=10).status_code == 200
    assert requests.get(management + "/info", timeout=10).json()["models"][0]["model_id"] == default_engine.model_name
    assert requests.post(management + "/", json={"inputs": "x"}, timeout=10).status_code == 404
    assert requests.get(management + "/metrics", timeout=10).status_code == 404
    assert requests.get(metrics_url + "/health", timeout=10).status_code == 404
    reply = requests.post(business + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}},
                          timeout=TIMEOUT)
    assert reply.status_code == 200
    scrape = requests.get(metrics_url + "/metrics", timeout=10).text
    assert re.search(r'^request_success_total\{model_name="[^"]+"\} 1\.0$', scrape, re.M), scrape
    state.start_draining()
    assert requests.get(management + "/health", timeout=10).status_code == 503


def test_serve_listens_on_one_port_per_plane(tmp_path, tiny_model_dir):
    port, management_port, metrics_port = free_ports(3)
    cfg = server_config(tiny_model_dir, port=port, managementPort=management_port, metricsPort=metrics_port)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--config", str(path)], cwd=REPO,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        # a thread, not select(): select cannot see lines already sitting in the pipe's read buffer
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
        urls, log = {}, []
        deadline = time.monotonic() + 240
        while len(urls) < 3 and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            log.append(line)
            match = re.search(r"listening on (http://\S+) \(([a-z, ]+);", line)
            if match:
                urls[match.group(2)] = match.group(1)
        assert urls == {"business": f"http://127.0.0.1:{port}", "management": f"http://127.0.0.1:{management_port}",
                        "metrics": f"http://127.0.0.1:{metrics_port}"}, "".join(log)[-3000:]
        while not any("ready:" in line for line in log) and time.monotonic() < deadline and proc.poll() is None:
            try:
                log.append(lines.get(timeout=1))
            except queue.Empty:
                continue
        assert requests.get(urls["management"] + "/health", timeout=10).status_code == 200
        assert requests.post(urls["business"] + "/generate", json={"inputs": "hello"}, timeout=60).status_code == 200
        scrape = requests.get(urls["metrics"] + "/metrics", timeout=10).text
        assert 'request_success_total{model_name="' in scrape
        assert requests.get(urls["business"] + "/health", timeout=10).status_code == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
