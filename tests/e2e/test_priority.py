"""Per-request ``priority`` through a real socket: every generation route carries it to the backend
(``RequestParams.priority``), out-of-range values are refused naming the field, and on the default model
``/info`` and ``/metrics`` count the engine's requests per priority while they run. The order itself is the
scheduler's (table tests in ``tests/backends/mindspore/test_scheduler.py``)."""
from __future__ import annotations

import threading

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_backend import FakeBackend


class RecordingBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.params = []

    def submit(self, inputs, params, listener=None, media=()):
        self.params.append(params)
        return super().submit(inputs, params, listener, media)


@pytest.fixture(scope="module")
def fake(live_servers):
    backend = RecordingBackend()
    return live_servers.start(backend), backend


ROUTES = [
    ("/", lambda p: {"inputs": "x", "parameters": {"priority": p}}, "parameters.priority"),
    ("/generate", lambda p: {"inputs": "x", "parameters": {"priority": p}}, "parameters.priority"),
    ("/generate_stream", lambda p: {"inputs": "x", "parameters": {"priority": p}}, "parameters.priority"),
    ("/v1/completions", lambda p: {"model": "fake", "prompt": "x", "priority": p}, "priority"),
    ("/v1/chat/completions", lambda p: {"model": "fake", "messages": [{"role": "user", "content": "x"}],
                                        "priority": p}, "priority"),
]


@pytest.mark.parametrize("path, body, field", ROUTES, ids=[r[0] for r in ROUTES])
@pytest.mark.parametrize("priority, expected", [(-3, -3), (7, 7), (None, 0), (-2147483648, -2147483648)])
def test_every_route_carries_the_priority_to_the_backend(fake, path, body, field, priority, expected):
    url, backend = fake
    reply = requests.post(url + path, json=body(priority), timeout=10)
    assert reply.status_code == 200, reply.text
    assert backend.params[-1].priority == expected


@pytest.mark.parametrize("path, body, field", ROUTES, ids=[r[0] for r in ROUTES])
@pytest.mark.parametrize("priority", [2147483648, 1.5, "high"])
def test_a_bad_priority_is_refused_naming_the_field(fake, path, body, field, priority):
    url, backend = fake
    submitted = len(backend.params)
    reply = requests.post(url + path, json=body(priority), timeout=10)
    assert reply.status_code in (400, 422), reply.text
    assert field in reply.text
    assert len(backend.params) == submitted


@pytest.fixture(scope="module")
def url(live_servers, default_engine):
    return live_servers.start(default_engine)


def _metrics_by_priority(text: str, model_name: str) -> dict[int, int]:
    """Requests per priority in a /metrics scrape (waiting + running), each series labelled with the model."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts: dict[int, int] = {}
    for name in ("num_requests_waiting_by_priority", "num_requests_running_by_priority"):
        for sample in families[name].samples:
            assert sample.labels["model_name"] == model_name
            priority = int(sample.labels["priority"])
            counts[priority] = counts.get(priority, 0) + int(sample.value)
    return counts


def test_info_and_metrics_count_the_requests_per_priority(url, default_engine):
    submitted = {-1: 1, 0: 2, 5: 1}
    body = {"model": default_engine.model_name, "prompt": "Once upon a time", "max_tokens": 128, "ignore_eos": True}
    threads = [threading.Thread(target=requests.post, args=(url + "/v1/completions",),
                                kwargs={"json": {**body, "priority": p}, "timeout": 120})
               for p, n in submitted.items() for _ in range(n)]
    for thread in threads:
        thread.start()
    # /info and /metrics are scraped separately, so each is polled until it has shown all four requests at once
    # (a scrape taken before the last request arrived or after the first finished shows fewer)
    seen_info, seen_metrics = {}, {}
    while (seen_info != submitted or seen_metrics != submitted) and any(t.is_alive() for t in threads):
        if seen_metrics != submitted:
            seen_metrics = _metrics_by_priority(requests.get(url + "/metrics", timeout=10).text,
                                                default_engine.model_name)
        if seen_info != submitted:
            info = requests.get(url + "/info", timeout=10).json()["mindserve"]["priorities"]
            seen_info = {int(p): c["waiting"] + c["running"] for p, c in info.items()}
    for thread in threads:
        thread.join(120)
    assert seen_info == submitted
    assert seen_metrics == submitted
    assert requests.get(url + "/info", timeout=10).json()["mindserve"]["priorities"] == {}
    assert _metrics_by_priority(requests.get(url + "/metrics", timeout=10).text, default_engine.model_name) == {}
