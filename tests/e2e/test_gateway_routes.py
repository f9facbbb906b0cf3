"""What a gateway reads of a replica, on a real socket (the fake backend stands in for the model): GET /v1/loads in
SGLang's shape, /v1/models' owned_by as ServerConfig.ownedBy says, the vLLM-named series on /metrics; with an API
key, /v1/loads stays open like /metrics."""
from __future__ import annotations

from dataclasses import replace

import pytest
import requests

from service.config import ServerSettings
from service.validation import default_schemas
from tests.support.fake_backend import FakeBackend


@pytest.fixture(scope="module")
def url(live_servers) -> str:
    return live_servers.start(FakeBackend(), replace(ServerSettings(), owned_by="vllm", api_key="k"))


def test_loads_in_sglangs_shape_without_the_key(url):
    reply = requests.get(url + "/v1/loads?include=core,disagg,queues,memory", timeout=10)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    default_schemas().validate("loads_response", body)
    assert body["dp_rank_count"] == 1 and body["loads"][0]["model"] == "fake"
    assert body["loads"][0]["num_running_reqs"] == 0


def test_loads_of_one_model_and_of_an_unknown_one(url):
    assert [x["model"] for x in requests.get(url + "/v1/loads?model=fake", timeout=10).json()["loads"]] == ["fake"]
    reply = requests.get(url + "/v1/loads?model=nope", timeout=10)
    assert reply.status_code == 404 and "nope" in reply.text


def test_owned_by_is_the_configured_one(url):
    reply = requests.get(url + "/v1/models", headers={"Authorization": "Bearer k"}, timeout=10)
    assert [m["owned_by"] for m in reply.json()["data"]] == ["vllm"]
    default_schemas().validate("model_list", reply.json())


def test_metrics_carry_the_vllm_series(url):
    text = requests.get(url + "/metrics", timeout=10).text
    assert 'vllm:num_requests_running{model_name="fake"} 0.0' in text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
