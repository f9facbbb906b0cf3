"""The playground in a real browser: headless Chromium (Debian's chromium + chromium-driver) driven by Selenium,
against live servers. On the default model, behind a business listener and a separate management listener
(the page can reach only the business one): the golden prompt, greedy, appears token by token; ``top_p`` 1.0
shows the server's 422 beside the field; Stop mid-stream frees the request in the server. On the fake backend:
the form follows the schema the server validates with (a changed schema changes the page), and the page
works over HTTPS."""
from __future__ import annotations

import json
import re
import ssl
import subprocess
import time
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from service.admission import Admission
from service.config import BUSINESS, MANAGEMENT, METRICS, ServerSettings
from service.connections import ConnectionTracker
from service.metrics import ServiceMetrics
from service.state import ServerState
from service.validation import SCHEMA_DIR, Schemas
from tests.support.browser import MISSING, chromium, find_chromium
from tests.support.fake_backend import FakeBackend, Pace
from tests.support.golden import GREEDY_TEXT, NUMPY_GOLDEN, PROMPT, PROMPT_IDS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_chromium() is None, reason=MISSING)]

from selenium.webdriver.common.by import By  # noqa: E402  (selenium is in the test extra)
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

TIMEOUT = 60
ENDED = ("done", "stopped", "refused", "failed", "ended")
# Records every state of #output as the page changes it (the test's own eyes; the page keeps no history).
# With stop_at, clicks the page's Stop button as soon as that many tokens are shown.
WATCH = """
const [stopAt] = arguments;
const out = document.getElementById("output");
window.__seen = [];
window.__observer?.disconnect();
window.__observer = new MutationObserver(() => {
  const tokens = Number(out.dataset.tokens || 0);
  window.__seen.push({text: out.textContent, tokens, t: performance.now()});
  if (stopAt && tokens >= stopAt && !window.__stopClicked) {
    window.__stopClicked = true;
    document.getElementById("stop").click();
  }
});
window.__observer.observe(out, {childList: true, subtree: true, characterData: true});
window.__stopClicked = false;
"""


# --- servers and the browser ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def split(live_servers, default_engine) -> tuple[str, str]:
    """(business URL, management URL) on the default model: two listeners sharing one state, admission,
    metrics and connection tracker, as ``serve`` runs them when managementPort differs from port."""
    settings = ServerSettings()
    shared = {"state": ServerState(ready=True), "metrics": ServiceMetrics.for_backend(default_engine),
              "admission": Admission(settings.max_link_num), "connections": ConnectionTracker(settings)}
    business = live_servers.start(default_engine, settings, planes={BUSINESS}, **shared)
    management = live_servers.start(default_engine, settings, planes={MANAGEMENT, METRICS}, **shared)
    return business, management


# --- what the test does in the page ---------------------------------------------------------------------

def open_page(driver, url: str) -> None:
    driver.get(url)
    WebDriverWait(driver, TIMEOUT).until(lambda d: d.find_element(By.ID, "status").text == "ready")


def set_field(driver, name: str, value: str) -> None:
    """Type into a parameter's control (or pick the option with that text); "" empties it."""
    control = driver.find_element(By.ID, f"param-{name}")
    if control.tag_name == "select":
        Select(control).select_by_visible_text(value)
    else:
        control.clear()
        if value:
            control.send_keys(value)


def generate(driver, prompt: str, *, stop_at: int = 0) -> str:
    """Submit ``prompt`` with the form as it is; wait for the run to end; its end state."""
    box = driver.find_element(By.ID, "inputs")
    box.clear()
    box.send_keys(prompt)
    driver.execute_script(WATCH, stop_at)
    driver.find_element(By.ID, "generate").click()
    WebDriverWait(driver, TIMEOUT).until(
        lambda d: d.find_element(By.ID, "output").get_attribute("data-state") in ENDED)
    return driver.find_element(By.ID, "output").get_attribute("data-state")


def text_of(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def token_rows(driver) -> list[list[str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#token-rows tr')].map(r => [...r.cells].map(c => c.textContent));")


def sent_body(driver) -> str:
    return driver.execute_script("return document.getElementById('request-body').textContent;")


def scrape(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if len(s.labels) == 1}


# --- the default model, through the management split ----------------------------------------------------

def test_golden_prompt_streams_token_by_token(browser, split):
    business, _ = split
    open_page(browser, business + "/")  # a browser's GET / is the page
    set_field(browser, "do_sample", "false")
    set_field(browser, "max_new_tokens", str(len(NUMPY_GOLDEN["generated_ids"])))
    assert generate(browser, PROMPT) == "done"

    assert text_of(browser, "output") == GREEDY_TEXT
    seen = browser.execute_script("return window.__seen;")
    states = [s for s in seen if s["text"]]
    assert all(GREEDY_TEXT.startswith(s["text"]) for s in states), states
    partial = sorted({s["text"] for s in states if s["text"] != GREEDY_TEXT}, key=len)
    assert len(partial) >= 5, f"the text did not appear token by token: {states}"
    first_partial = min(s["t"] for s in states if s["text"] in partial)
    assert max(s["t"] for s in states) - first_partial > 0, "every state was shown at once"

    rows = token_rows(browser)
    assert [int(r[1]) for r in rows] == NUMPY_GOLDEN["generated_ids"]
    assert all(float(r[3]) <= 0 and 0 < float(r[4]) <= 1 for r in rows)  # logprob and p of each token
    assert text_of(browser, "stat-tokens") == str(len(rows))
    assert text_of(browser, "stat-finish") == "length"
    assert re.fullmatch(r"\d+ ms", text_of(browser, "stat-ttft"))
    assert float(text_of(browser, "stat-rate")) > 0
    assert json.loads(sent_body(browser)) == {
        "inputs": PROMPT, "parameters": {"do_sample": False, "max_new_tokens": 20, "details": True}, "stream": True}


def test_a_bad_value_shows_the_servers_422_beside_its_field(browser, split):
    business, _ = split
    open_page(browser, business + "/playground")
    set_field(browser, "top_p", "1.0")
    assert generate(browser, PROMPT) == "refused"

    body = sent_body(browser)
    assert '"top_p": 1.0' in body  # sent as typed
    expected = requests.post(business + "/", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert expected.status_code == 422
    message = expected.json()["error"]
    assert "top_p" in message
    field = browser.find_element(By.CSS_SELECTOR, '[data-field="top_p"]')
    assert "invalid" in field.get_attribute("class").split()
    assert field.find_element(By.CLASS_NAME, "field-error").text == message
    assert message in text_of(browser, "error") and "422" in text_of(browser, "error")
    assert text_of(browser, "output") == ""


def test_stop_mid_stream_frees_the_request(browser, split):
    business, management = split
    open_page(browser, business + "/playground")
    set_field(browser, "do_sample", "false")
    set_field(browser, "max_new_tokens", "64")  # the test engine's maxIterTimes
    before = scrape(management)
    assert generate(browser, PROMPT, stop_at=3) == "stopped"

    shown = int(browser.find_element(By.ID, "output").get_attribute("data-tokens"))
    assert 3 <= shown < 64
    assert f"stopped after {shown} tokens" == text_of(browser, "run-state")
    deadline = time.monotonic() + 10
    while True:
        info = requests.get(management + "/info", timeout=10).json()
        engine, http = info["mindserve"], info["mindserve"]["http"]
        if engine["running"] == 0 and engine["waiting"] == 0 and http["slots_in_use"] == 0:
            break
        assert time.monotonic() < deadline, f"the request was not freed: {info['mindserve']}"
        time.sleep(0.05)
    after = scrape(management)
    # The server saw the client leave before the end: a failed request (a disconnect), not a success.
    assert after["request_failed_total"] - before.get("request_failed_total", 0) == 1
    assert after["request_success_total"] == before.get("request_success_total", 0)
    assert GREEDY_TEXT.startswith(text_of(browser, "output"))


def test_without_streaming_the_prompt_and_generated_tokens_are_listed(browser, split):
    business, _ = split
    open_page(browser, business + "/playground")
    browser.find_element(By.ID, "stream").click()
    set_field(browser, "do_sample", "false")
    set_field(browser, "max_new_tokens", "3")
    set_field(browser, "decoder_input_details", "true")
    assert generate(browser, PROMPT) == "done"
    rows = token_rows(browser)
    assert [int(r[1]) for r in rows if r[0] == "prompt"] == PROMPT_IDS
    assert [int(r[1]) for r in rows if r[0] != "prompt"] == NUMPY_GOLDEN["generated_ids"][:3]
    assert GREEDY_TEXT.startswith(text_of(browser, "output")) and text_of(browser, "stat-prompt") == "8"


def test_the_page_needs_nothing_from_the_management_port(browser, split):
    """The model is named from v1/models (business port); the adapter picker stays hidden (no adapters
    listed there) and the structured-output field shows exactly when the served schema takes a grammar."""
    business, _ = split
    browser.get_log("browser")  # drop what earlier tests logged (the 422 above)
    open_page(browser, business + "/")
    assert not browser.find_element(By.ID, "adapter-field").is_displayed()
    grammar = requests.get(business + "/openapi.json", timeout=10).json()["components"]["schemas"]["parameters"][
        "properties"].get("grammar", {"enum": [None]})
    assert browser.find_element(By.ID, "grammar-field").is_displayed() == (grammar.get("enum") != [None])
    assert text_of(browser, "model") == requests.get(business + "/v1/models", timeout=10).json()["data"][0]["id"]
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_structured_output_from_the_page(browser, split):
    business, _ = split
    open_page(browser, business + "/playground")
    kinds = Select(browser.find_element(By.ID, "grammar-type"))
    assert [o.get_attribute("value") for o in kinds.options] == ["", "json", "regex"]
    kinds.select_by_value("regex")
    browser.find_element(By.ID, "grammar-value").send_keys("(yes|no)")
    set_field(browser, "do_sample", "false")
    assert generate(browser, "Is the sky blue? Answer:") == "done"
    assert text_of(browser, "output") in ("yes", "no")
    assert text_of(browser, "stat-finish") in ("eos_token", "stop_sequence")
    assert json.loads(sent_body(browser))["parameters"]["grammar"] == {"type": "regex", "value": "(yes|no)"}


# --- the form follows the server's schema -----------------------------------------------------------------

GRAMMAR = {"description": "Structured output (a test schema)", "type": ["object", "null"],
           "required": ["type", "value"], "additionalProperties": False,
           "properties": {"type": {"enum": ["json", "regex"]}, "value": {}}}


@pytest.fixture(scope="module")
def changed_schema_url(live_servers, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    """A server validating with a changed parameters schema (max_new_tokens ≤ 77, a grammar accepted)."""
    folder = tmp_path_factory.mktemp("schemas")
    for entry in SCHEMA_DIR.iterdir():
        if entry.name.endswith(".schema.json"):
            (folder / entry.name).write_bytes(entry.read_bytes())
    params = json.loads((folder / "parameters.schema.json").read_text(encoding="utf-8"))
    params["properties"]["max_new_tokens"]["maximum"] = 77
    params["properties"]["grammar"] = GRAMMAR
    (folder / "parameters.schema.json").write_text(json.dumps(params), encoding="utf-8")
    return live_servers.start(FakeBackend(), schemas=Schemas(folder)), params


def test_the_form_is_built_from_the_schema_the_server_validates_with(browser, changed_schema_url):
    url, params = changed_schema_url
    open_page(browser, url + "/playground")
    for name in params["properties"]:
        assert browser.find_elements(By.CSS_SELECTOR, f'[data-field="{name}"]'), f"no control for {name}"
    max_new = browser.find_element(By.ID, "param-max_new_tokens")
    assert (max_new.get_attribute("min"), max_new.get_attribute("max")) == ("1", "77")
    top_k = params["properties"]["top_k"]
    assert browser.find_element(By.ID, "param-top_k").get_attribute("max") == str(top_k["maximum"])
    assert browser.find_element(By.ID, "param-typical_p").get_attribute("max") == "1"

    assert browser.find_element(By.ID, "grammar-field").is_displayed()
    kinds = [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "grammar-type")).options]
    assert kinds == ["", "json", "regex"]
    Select(browser.find_element(By.ID, "grammar-type")).select_by_value("json")
    browser.find_element(By.ID, "grammar-value").send_keys('{"type": "object"}')
    generate(browser, "x")
    assert json.loads(sent_body(browser))["parameters"]["grammar"] == {"type": "json", "value": {"type": "object"}}


# --- the page's own pieces, run in the browser --------------------------------------------------------------

RUN_MODULE = """
const done = arguments[arguments.length - 1];
(async () => { const m = await import(new URL("playground/%s", location.href).href); %s })()
  .then(done, (e) => done("error: " + e));
"""


def run_module(driver, name: str, body: str) -> Any:
    """``body`` (an async function body) run with the page's module ``name`` as ``m``; its return value. (The
    page's CSP refuses eval, so the body is part of the WebDriver script.)"""
    return driver.execute_async_script(RUN_MODULE % (name, body))


def test_sse_parsing_survives_any_chunking(browser, changed_schema_url):
    open_page(browser, changed_schema_url[0] + "/playground")
    text = ('data: {"a":1}\r\n\r\ndata: x\ndata: y\n\n: keep-alive\n\nevent: e\ndata:z\r\r'
            'data: p\r\ndata: q\r\n\r\ndata: last')
    expected = ['{"a":1}', "x\ny", "z", "p\nq", "last"]
    for size in (1, 2, 3, 7, len(text)):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        got = run_module(browser, "sse.js", """
            const chunks = %s, out = [];
            const body = new ReadableStream({start(c) {
                for (const x of chunks) c.enqueue(new TextEncoder().encode(x)); c.close(); }});
            for await (const data of m.sseData(body)) out.push(data);
            return out;""" % json.dumps(chunks))
        assert got == expected, (size, got)


def test_numbers_are_sent_as_typed(browser, changed_schema_url):
    open_page(browser, changed_schema_url[0] + "/playground")
    got = run_module(browser, "schema_form.js", """
        return m.toJson({seed: new m.RawNumber("18446744073709551615"), top_p: new m.RawNumber("1.0"),
                         inputs: "raw:1 \\"quoted\\" 18446744073709551615", n: 0.5});""")
    assert json.loads(got) == {"seed": 18446744073709551615, "top_p": 1.0,
                               "inputs": 'raw:1 "quoted" 18446744073709551615', "n": 0.5}
    assert '"top_p": 1.0' in got and '"seed": 18446744073709551615' in got


# --- HTTPS ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def https_url(live_servers, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=folder, check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    return live_servers.start(FakeBackend(Pace(tokens=4, delay=0.01)), ssl_options=context)


def test_the_page_works_over_https(browser, https_url):
    assert https_url.startswith("https://")
    open_page(browser, https_url + "/")
    assert generate(browser, "x") == "done"
    assert text_of(browser, "output") == "aaaa"
    assert browser.execute_script("return location.protocol;") == "https:"
    browser.find_element(By.ID, "stream").click()  # off: one JSON answer
    assert generate(browser, "x") == "done"
    assert text_of(browser, "output") == "aaaa" and text_of(browser, "stat-finish") == "length"
    assert json.loads(sent_body(browser))["stream"] is False
