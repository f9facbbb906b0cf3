"""Two real replicas (the default model, small context) behind the real Shepherd Model Gateway (``smg launch``,
deploy/fleet/fleet.py): the gateway reads each replica's load through the contract, and its ``least_load`` and
``power_of_two`` policies follow it.

Replica 0 says ``owned_by: "vllm"`` (SMG polls its /metrics in vLLM's names), replica 1 keeps ``mindserve`` (SMG
polls its GET /v1/loads). Each in turn is loaded with long streams sent to it directly, past the gateway, so the
gateway knows of that load only what the replica reports; SMG's /get_loads must show it, and the next requests
through the gateway must all go to the other replica (by chance: 1 in 8 per phase). Decode steps are slowed so the
streams outlast each phase; every wait is bounded.
"""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import requests

from tests.support.fleet import local_fleet, smg_binary
from tests.support.http import until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smg_binary() is None, reason="smg is not installed (pip install smg==1.13.0, "
                                                                  "setup.cfg extra gateway)")]

SLOW_DECODE = 0.05      # s per decode step on both replicas: a 400-token stream lasts > 20 s
LOAD_STREAMS = 4        # with --max-batch-size 2: two run, two wait
PROBES = 3              # requests through the gateway per phase
POLL = 1                # SMG --load-monitor-interval (s)
TIMEOUT = 60


class Streams:
    """``n`` long streamed completions sent straight to ``url``, held open until ``close()``: each stream then
    disconnects at its next event (a queued one at its first), which cancels it on the replica."""

    def __init__(self, url: str, model: str, n: int) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        body = {"model": model, "prompt": "Write a very long story about a lighthouse.", "max_tokens": 400,
                "stream": True, "ignore_eos": True}
        self.threads = [threading.Thread(target=self._run, args=(url, body), daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, body: dict) -> None:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=TIMEOUT) as reply:
            self.statuses.append(reply.status_code)
            for _ in reply.iter_lines():
                if self._stop.is_set():
                    break

    def close(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(TIMEOUT)


def gateway_loads(gateway: str) -> dict[str, dict]:
    """SMG's /get_loads: {worker URL: its load entry}."""
    body = requests.get(gateway + "/get_loads", timeout=10).json()
    return {entry["worker"].rstrip("/"): entry for entry in body.get("loads", [])}


def received(url: str) -> float:
    """The replica's request_received_total (generation requests it took)."""
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("request_received_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no request_received_total in /metrics")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, default_q4_dir):
    """The two replicas (deploy/fleet/fleet.py without its gateway)."""
    f = local_fleet(tmp_path_factory.mktemp("fleet"), 2, gateway=False, slow_decode=SLOW_DECODE,
                    serve_args=[str(default_q4_dir), "--ctx-size", "512", "--max-batch-size", "2"],
                    replica_args=[["--owned-by", "vllm"], []])
    with f:
        yield f


@pytest.fixture(scope="module", params=["least_load", "power_of_two"])
def fleet(request, replicas, tmp_path_factory):
    """SMG with one policy in front of the replicas (the launcher's gateway-only mode); ``replica_urls`` and
    ``gateway_url`` as a whole fleet has them."""
    gateway = local_fleet(tmp_path_factory.mktemp(request.param), 0, policy=request.param,
                          worker_urls=replicas.replica_urls,
                          gateway_args=["--load-monitor-interval", str(POLL), "--log-level", "warn"])
    with gateway:
        yield SimpleNamespace(replica_urls=replicas.replica_urls, gateway_url=gateway.gateway_url)


@pytest.fixture(scope="module")
def model(replicas) -> str:
    return requests.get(replicas.replica_urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_the_gateway_classifies_each_replica_by_owned_by(fleet):
    workers = {w["url"].rstrip("/"): w for w in requests.get(fleet.gateway_url + "/workers", timeout=10).json()[
        "workers"]}
    vllm, ours = fleet.replica_urls
    assert workers[vllm]["runtime_type"] == "vllm" and workers[ours]["runtime_type"] != "vllm", workers
    assert all(w["is_healthy"] for w in workers.values())


@pytest.mark.parametrize("loaded", [0, 1], ids=["vllm-metrics", "v1-loads"])
def test_least_load_sends_the_next_requests_to_the_replica_not_loaded(fleet, model, loaded):
    urls = fleet.replica_urls
    busy, idle = urls[loaded], urls[1 - loaded]
    assert until(lambda: set(gateway_loads(fleet.gateway_url)) == set(urls), 15), gateway_loads(fleet.gateway_url)
    streams = Streams(busy, model, LOAD_STREAMS)
    try:
        def gateway_sees_the_load() -> bool:
            entry = gateway_loads(fleet.gateway_url).get(busy, {})
            return entry.get("num_running_reqs", 0) >= 2 and entry.get("num_waiting_reqs", 0) >= 1

        assert until(gateway_sees_the_load, 30, poll=0.5), gateway_loads(fleet.gateway_url)
        loads = gateway_loads(fleet.gateway_url)
        assert loads[busy]["token_usage"] > loads[idle]["token_usage"], loads
        if loaded == 1:  # /v1/loads carries absolute KV-cache tokens too; /metrics only the ratio
            assert loads[busy]["max_total_num_tokens"] > 0 and loads[busy]["num_used_tokens"] > 0, loads
            assert loads[busy]["num_waiting_uncached_tokens"] > 0, loads  # the queued prompts, still to prefill
        before = [received(u) for u in urls]
        for _ in range(PROBES):
            time.sleep(POLL + 1)  # a fresh load poll: the previous probe's booking is gone
            reply = requests.post(fleet.gateway_url + "/v1/completions", timeout=TIMEOUT,
                                  json={"model": model, "prompt": "Hi", "max_tokens": 2})
            assert reply.status_code == 200, reply.text
        after = [received(u) for u in urls]
        assert streams.statuses and set(streams.statuses) == {200}, streams.statuses
        assert after[1 - loaded] - before[1 - loaded] == PROBES and after[loaded] == before[loaded], (before, after)
    finally:
        streams.close()
    assert until(lambda: gateway_loads(fleet.gateway_url).get(busy, {}).get("num_running_reqs") == 0, 30, poll=0.5)


def test_cached_tokens_reach_the_client_through_the_gateway(fleet, model):
    """A prompt longer than a cache block, sent twice to one replica: the second usage reports the cached part;
    the stream's include_usage chunk comes through the gateway with it."""
    prompt = " ".join(f"word{i}" for i in range(90))  # 128 < tokens < 511 (--ctx-size 512)
    direct = fleet.replica_urls[0] + "/v1/completions"
    first = requests.post(direct, json={"model": model, "prompt": prompt, "max_tokens": 1}, timeout=TIMEOUT).json()
    second = requests.post(direct, json={"model": model, "prompt": prompt, "max_tokens": 1}, timeout=TIMEOUT).json()
    assert 128 < first["usage"]["prompt_tokens"], first
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128, second["usage"]
    reply = requests.post(fleet.gateway_url + "/v1/completions", timeout=TIMEOUT, stream=True, json={
        "model": model, "prompt": "Hello", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith(b"data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
