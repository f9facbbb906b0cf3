"""``ServerConfig.apiKey`` (``serve --api-key``) on a real socket: the business routes want ``Authorization: Bearer
KEY`` and answer 401 in their own error shape without it; health, /info, /metrics, /openapi.json and the playground
stay open. The fake backend stands in for the model (the key is checked before any backend call)."""
from __future__ import annotations

import pytest
import requests

from service.config import ServerSettings
from tests.support.fake_backend import FakeBackend

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}
TGI_BODY = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
CHAT_BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed_url(live_servers) -> str:
    return live_servers.start(FakeBackend(), ServerSettings(api_key=KEY))


@pytest.fixture(scope="module")
def open_url(live_servers) -> str:
    return live_servers.start(FakeBackend())


TGI_ROUTES = [("POST", "/", TGI_BODY), ("POST", "/generate", TGI_BODY), ("POST", "/generate_stream", TGI_BODY),
              ("POST", "/v1/tokenizer", {"inputs": "hi"})]
OPENAI_ROUTES = [("POST", "/v1/chat/completions", CHAT_BODY),
                 ("POST", "/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2}),
                 ("POST", "/tokenize", {"prompt": "hi"}), ("GET", "/v1/models", None), ("GET", "/v1/models/fake", None)]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize("method, path, body", TGI_ROUTES + OPENAI_ROUTES)
def test_business_routes_without_the_key_are_401_in_their_shape(keyed_url, headers, method, path, body):
    reply = requests.request(method, keyed_url + path, json=body, headers=headers, timeout=10)
    assert reply.status_code == 401, reply.text
    assert reply.headers["WWW-Authenticate"] == "Bearer"
    error = reply.json()["error"]
    if (method, path, body) in OPENAI_ROUTES:
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert "API key" in error["message"]
    else:
        assert reply.json()["error_type"] == "Unauthorized" and "API key" in error
    assert KEY not in reply.text


@pytest.mark.parametrize("method, path, body", TGI_ROUTES + OPENAI_ROUTES)
def test_business_routes_with_the_key_answer(keyed_url, method, path, body):
    reply = requests.request(method, keyed_url + path, json=body, headers=GOOD, timeout=10)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("path", ["/health", "/v2/health/live", "/v2/health/ready", "/info", "/metrics",
                                  "/openapi.json", "/playground"])
def test_operations_routes_stay_open(keyed_url, path):
    assert requests.get(keyed_url + path, timeout=10).status_code == 200


def test_without_a_key_configured_nothing_is_asked(open_url):
    assert requests.post(open_url + "/", json=TGI_BODY, timeout=10).status_code == 200
    assert requests.get(open_url + "/v1/models", timeout=10).status_code == 200
