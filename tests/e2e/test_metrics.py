"""``GET /metrics`` on a live server: the reference names with ``model_name``, scraped in the Prometheus
text format, and counters that move by exactly what the requests did.

Counting rule under test (service/metrics.py): every request to a generation route is *received*; it
then ends as *success* (response or stream delivered) or *failed* (any error status — a 422 included —,
or a client disconnect). Token totals and histograms count successful requests only.
"""
from __future__ import annotations

import json
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.metrics import delta, scrape

TIMEOUT = 120
PROMPT = "My name is Olivier and I"
COUNTERS = ("request_received_total", "request_success_total", "request_failed_total", "prompt_tokens_total",
            "generation_tokens_total")
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_prompt_tokens", "request_generation_tokens")
STEP_HISTOGRAMS = ("engine_step_duration_seconds", "engine_step_tokens")
GAUGES = ("num_requests_running", "num_requests_waiting", "cpu_cache_usage_perc", "prefix_cache_hit_rate",
          "prefix_cache_blocks")


def error_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """error_type → how much ``request_errors_total`` moved for it (types that did not move left out)."""
    prefix = "request_errors_total{error_type="
    moved = {key[len(prefix):-1]: delta(before, after, key) for key in {*before, *after} if key.startswith(prefix)}
    return {kind: n for kind, n in moved.items() if n}


@pytest.fixture(scope="module")
def metrics_url(live_servers, default_engine):
    """A server of its own, so its registry sees only this module's requests."""
    return live_servers.start(default_engine)


def test_every_reference_metric_is_exposed_with_the_model_name(metrics_url, default_engine):
    text = requests.get(metrics_url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in COUNTERS:
        assert families[name.removesuffix("_total")].type == "counter", name
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
    for name in STEP_HISTOGRAMS:
        assert families[name].type == "histogram", name
        assert {(s.labels["model_name"], s.labels["kind"]) for s in families[name].samples} == {
            (default_engine.model_name, kind) for kind in ("decode", "prefill")}
    for name in GAUGES:
        assert families[name].type == "gauge", name
        (sample,) = families[name].samples
        assert sample.labels == {"model_name": default_engine.model_name}
    assert 0.0 <= families["cpu_cache_usage_perc"].samples[0].value <= 1.0


def test_counters_move_by_exactly_what_the_requests_did(metrics_url):
    before = scrape(metrics_url)
    text = requests.post(metrics_url + "/", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 5, "details": True}}, timeout=TIMEOUT)
    stream = requests.post(metrics_url + "/generate_stream", json={"inputs": "Hello", "parameters": {
        "max_new_tokens": 7, "details": True}}, timeout=TIMEOUT)
    invalid = requests.post(metrics_url + "/generate", json={"inputs": PROMPT, "parameters": {"top_p": 1.0}},
                            timeout=10)
    assert (text.status_code, stream.status_code, invalid.status_code) == (200, 200, 422)
    details = [text.json()[0]["details"],
               [json.loads(e[5:]) for e in stream.text.split("\n\n") if e.startswith("data:")][-1]["details"]]
    after = scrape(metrics_url)
    assert delta(before, after, "request_received_total") == 3
    assert delta(before, after, "request_success_total") == 2
    assert delta(before, after, "request_failed_total") == 1
    assert error_deltas(before, after) == {"Input Validation Error": 1}
    prompt = sum(d["prompt_tokens"] for d in details)
    generated = sum(d["generated_tokens"] for d in details)
    assert delta(before, after, "prompt_tokens_total") == prompt
    assert delta(before, after, "generation_tokens_total") == generated
    assert delta(before, after, "adapter_requests_total{adapter=None}{outcome=success}") == 2  # the base model
    assert delta(before, after, "adapter_requests_total{adapter=None}{outcome=failed}") == 1
    assert delta(before, after, "adapter_generation_tokens_total{adapter=None}") == generated
    assert delta(before, after, "request_prompt_tokens_count") == 2
    assert delta(before, after, "request_prompt_tokens_sum") == prompt
    assert delta(before, after, "request_generation_tokens_sum") == generated
    assert delta(before, after, "e2e_request_latency_seconds_count") == 2
    assert delta(before, after, "time_to_first_token_seconds_count") == 2
    assert delta(before, after, "time_per_output_token_seconds_count") == generated - 2
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0


def _step_counts(figures: dict[str, float]) -> tuple[float, ...]:
    return tuple(figures.get(f"engine_step_{name}_count{{kind={kind}}}", 0.0)
                 for name in ("duration_seconds", "tokens") for kind in ("prefill", "decode"))


def _settled(url: str, deadline: float, moved=lambda figures: True) -> dict[str, float]:
    """A scrape once ``moved`` holds of it and the step counts stay put for 50 ms: the engine thread records a
    step after that step's results went out, so a scrape right after a reply may not have its last step yet."""
    last = None
    while True:
        figures = scrape(url)
        if last is not None and moved(figures) and _step_counts(figures) == _step_counts(last):
            return figures
        assert time.monotonic() < deadline, "the engine's step counts never settled"
        last = figures
        time.sleep(0.05)


def test_engine_steps_are_counted_by_kind(metrics_url):
    """One request alone: its prompt (under one chunk and one cache part) is one prefill step of its tokens, each
    later token one decode step of one token; every step has a wall time."""
    deadline = time.monotonic() + 60
    while (info := requests.get(metrics_url + "/info", timeout=10).json()["mindserve"])["running"] + info["waiting"]:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.05)
    before = _settled(metrics_url, deadline)
    reply = requests.post(metrics_url + "/", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "details": True}}, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    details = reply.json()[0]["details"]
    want = {"prefill": 1, "decode": details["generated_tokens"] - 1}

    def steps(figures: dict[str, float]) -> dict[str, float]:
        return {kind: delta(before, figures, f"engine_step_duration_seconds_count{{kind={kind}}}") for kind in want}

    after = _settled(metrics_url, time.monotonic() + 30, lambda figures: steps(figures) == want)
    assert steps(after) == want
    assert delta(before, after, "engine_step_tokens_sum{kind=prefill}") == details["prompt_tokens"]
    assert delta(before, after, "engine_step_tokens_sum{kind=decode}") == details["generated_tokens"] - 1
    for kind in ("prefill", "decode"):
        assert delta(before, after, f"engine_step_tokens_count{{kind={kind}}}") == want[kind]
        assert delta(before, after, f"engine_step_duration_seconds_sum{{kind={kind}}}") > 0
        buckets = sorted((float(key.split("{le=")[1][:-1]), value) for key, value in after.items()
                         if key.startswith(f"engine_step_duration_seconds_bucket{{kind={kind}}}"))
        assert [n for _, n in buckets] == sorted(n for _, n in buckets)  # cumulative
        assert buckets[-1] == (float("inf"), after[f"engine_step_duration_seconds_count{{kind={kind}}}"])


def test_prompt_rejected_by_the_engine_counts_as_failed(metrics_url):
    before = scrape(metrics_url)
    reply = requests.post(metrics_url + "/", json={"inputs": "word " * 400}, timeout=TIMEOUT)
    assert reply.status_code == 422
    after = scrape(metrics_url)
    assert delta(before, after, "request_received_total") == 1
    assert delta(before, after, "request_failed_total") == 1
    assert delta(before, after, "request_success_total") == 0
    assert delta(before, after, "prompt_tokens_total") == 0
    assert error_deltas(before, after) == {"Input Validation Error": 1}


def test_client_disconnect_mid_stream_counts_as_failed(metrics_url):
    before = scrape(metrics_url)
    with requests.post(metrics_url + "/generate_stream", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 60, "do_sample": False}}, stream=True, timeout=TIMEOUT) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())  # the first event arrived; now hang up
    deadline = time.monotonic() + 30
    after = scrape(metrics_url)
    while delta(before, after, "request_failed_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        after = scrape(metrics_url)
    assert delta(before, after, "request_received_total") == 1
    assert delta(before, after, "request_failed_total") == 1
    assert delta(before, after, "request_success_total") == 0
    assert error_deltas(before, after) == {"Client Gone": 1}


def test_the_prefix_cache_is_reported_in_metrics_and_info(metrics_url):
    """A prompt that starts with another's full cache blocks is counted as a hit in /metrics and /info."""
    system = "You are a helpful assistant who answers in one short sentence. " * 8  # > one 64-token block
    before, info_before = scrape(metrics_url), requests.get(metrics_url + "/info", timeout=10).json()
    for question in ("What is the capital of France?", "Why is the sky blue?"):
        reply = requests.post(metrics_url + "/", json={"inputs": system + question, "parameters": {
            "max_new_tokens": 2}}, timeout=TIMEOUT)
        assert reply.status_code == 200, reply.text
    after, info = scrape(metrics_url), requests.get(metrics_url + "/info", timeout=10).json()
    cache = info["mindserve"]["prefix_cache"]
    assert cache["enabled"] is True and cache["cached_blocks"] == after["prefix_cache_blocks"] >= 1
    assert cache["hit_tokens"] - info_before["mindserve"]["prefix_cache"]["hit_tokens"] >= 64  # the second prompt
    assert after["prefix_cache_hit_rate"] == cache["hit_rate"] and 0 < cache["hit_rate"] <= 1
    assert before["prefix_cache_hit_rate"] <= 1


def test_routes_outside_generation_are_not_counted(metrics_url):
    before = scrape(metrics_url)
    requests.post(metrics_url + "/v1/tokenizer", json={"inputs": "hi"}, timeout=10)
    requests.get(metrics_url + "/info", timeout=10)
    requests.get(metrics_url + "/nowhere", timeout=10)
    after = scrape(metrics_url)
    assert delta(before, after, "request_received_total") == 0


def test_each_app_has_its_own_registry(live_servers, default_engine, metrics_url):
    other = live_servers.start(default_engine)
    assert scrape(other).get("request_received_total", 0.0) == 0.0
    assert scrape(metrics_url)["request_received_total"] > 0
