"""The playground's routes on a real socket: the page at ``/playground`` and for a browser's ``GET /``, the
root document for any other ``GET /`` (``service/root.py``), ``POST /`` as before, its files, the config key
that turns it off, and the management split."""
from __future__ import annotations

from dataclasses import replace

import pytest
import requests

from service.config import BUSINESS, MANAGEMENT, METRICS, ServerSettings
from service.playground import load_assets
from tests.support.fake_backend import FakeBackend, Pace
from service.validation import default_schemas
from tests.support.http import error_json

TIMEOUT = 30
BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


@pytest.fixture(scope="module")
def url(live_servers):
    return live_servers.start(FakeBackend(Pace(tokens=3)))


@pytest.fixture(scope="module")
def url_off(live_servers):
    return live_servers.start(FakeBackend(), replace(ServerSettings(), playground_enabled=False))


def _is_page(reply: requests.Response) -> None:
    assert reply.status_code == 200, reply.text
    assert reply.headers["Content-Type"] == "text/html; charset=utf-8"
    assert reply.content == load_assets()["playground.html"].body
    assert "connect-src 'self'" in reply.headers["Content-Security-Policy"]
    assert reply.headers["X-Request-Id"]


def test_playground_route_serves_the_page_to_anyone(url):
    _is_page(requests.get(url + "/playground", timeout=TIMEOUT))
    _is_page(requests.get(url + "/playground", headers={"Accept": "application/json"}, timeout=TIMEOUT))


def test_a_browser_get_of_the_root_gets_the_page(url):
    _is_page(requests.get(url + "/", headers=BROWSER, timeout=TIMEOUT))
    head = requests.head(url + "/", headers=BROWSER, timeout=TIMEOUT)
    assert head.status_code == 200 and head.content == b"" and head.headers["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("headers", [{}, {"Accept": "*/*"}, {"Accept": "application/json"},
                                     {"Accept": "application/json, text/html;q=0.5"}])
def test_any_other_get_of_the_root_gets_the_root_document(url, headers):
    reply = requests.get(url + "/", headers=headers, timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.headers["Content-Type"] == "application/json"
    body = reply.json()
    default_schemas().validate("root_response", body)
    assert body["openapi"] == "/openapi.json" and body["playground"] == "/playground" and body["model"] == "fake"
    assert requests.get(url + body["openapi"], timeout=TIMEOUT).status_code == 200
    head = requests.head(url + "/", headers=headers, timeout=TIMEOUT)
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS"])
def test_other_methods_on_the_root_are_405_with_allow(url, method):
    reply = requests.request(method, url + "/", timeout=TIMEOUT)
    assert method in error_json(reply, 405, "Method Not Allowed")
    assert reply.headers["Allow"] == "GET, HEAD, POST"


def test_post_root_is_untouched_even_with_a_browser_accept(url):
    for headers in ({}, BROWSER):
        reply = requests.post(url + "/", json={"inputs": "x", "parameters": {"max_new_tokens": 2}},
                              headers=headers, timeout=TIMEOUT)
        assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("application/json")
        assert reply.json() == [{"generated_text": "aa"}]


@pytest.mark.parametrize("name, kind", [("playground.js", "text/javascript"), ("schema_form.js", "text/javascript"),
                                        ("sse.js", "text/javascript"), ("playground.css", "text/css")])
def test_the_page_files(url, name, kind):
    reply = requests.get(f"{url}/playground/{name}", timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.headers["Content-Type"] == f"{kind}; charset=utf-8"
    assert reply.content == load_assets()[name].body and reply.headers["X-Content-Type-Options"] == "nosniff"
    again = requests.get(f"{url}/playground/{name}", headers={"If-None-Match": reply.headers["Etag"]},
                         timeout=TIMEOUT)
    assert again.status_code == 304  # revalidated, not downloaded again


@pytest.mark.parametrize("path", ["/playground/nope.js", "/playground/../service/app.py", "/playground/%2e%2e%2fx.js",
                                  "/playground/"])
def test_unknown_files_are_404(url, path):
    error_json(requests.get(url + path, timeout=TIMEOUT), 404, "NotFoundError")


def test_the_config_key_turns_it_off(url_off):
    error_json(requests.get(url_off + "/playground", timeout=TIMEOUT), 404, "NotFoundError")
    error_json(requests.get(url_off + "/playground/playground.js", timeout=TIMEOUT), 404, "NotFoundError")
    root = requests.get(url_off + "/", headers=BROWSER, timeout=TIMEOUT)
    assert root.status_code == 200 and root.json()["playground"] is None
    paths = requests.get(url_off + "/openapi.json", timeout=TIMEOUT).json()["paths"]
    assert "/playground" not in paths and list(paths["/"]["get"]["responses"]["200"]["content"]) == ["application/json"]


def test_openapi_documents_the_page(url):
    paths = requests.get(url + "/openapi.json", timeout=TIMEOUT).json()["paths"]
    assert "text/html" in paths["/playground"]["get"]["responses"]["200"]["content"]
    assert "text/html" in paths["/"]["get"]["responses"]["200"]["content"] and "post" in paths["/"]


def test_with_the_management_split_the_page_and_what_it_calls_are_on_the_business_port(live_servers):
    """The page calls POST /, openapi.json and v1/models (tests/service/test_playground.py checks that it
    calls nothing else): all on the business listener, none on the management one."""
    backend = FakeBackend(Pace(tokens=2))
    business = live_servers.start(backend, planes={BUSINESS})
    management = live_servers.start(backend, planes={MANAGEMENT, METRICS})
    _is_page(requests.get(business + "/", headers=BROWSER, timeout=TIMEOUT))
    for path in ("/openapi.json", "/v1/models"):
        assert requests.get(business + path, timeout=TIMEOUT).status_code == 200, path
    assert requests.post(business + "/", json={"inputs": "x"}, timeout=TIMEOUT).status_code == 200
    assert requests.get(business + "/info", timeout=TIMEOUT).status_code == 404
    assert requests.get(management + "/playground", timeout=TIMEOUT).status_code == 404
