"""The playground's chat mode in headless Chromium, on the tiny Qwen3-like chat model
(tests/support/tiny_chat_model.py): a two-message conversation streamed through /v1/chat/completions, each
answer equal to the route's own non-streamed answer to the same conversation (asked here with requests);
a reasoning block shown collapsed; tool calls shown; a refused request shown with its field and kept out of
the conversation."""
from __future__ import annotations

import json

import pytest
import requests

from tests.support.browser import MISSING, chromium, find_chromium
from tests.support.tiny_chat_model import marker_ids

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_chromium() is None, reason=MISSING)]

from selenium.webdriver.common.by import By  # noqa: E402  (selenium is in the test extra)
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

TIMEOUT = 90
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def browser():
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def name(chat_url) -> str:
    return requests.get(chat_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def open_chat(driver, url: str) -> None:
    driver.get_log("browser")  # what an earlier page logged
    driver.get(url + "/playground#chat")
    WebDriverWait(driver, TIMEOUT).until(lambda d: d.find_element(By.ID, "chat-mode").is_displayed())
    assert not driver.find_element(By.ID, "prompt-mode").is_displayed()


def settings(driver, *, max_tokens: int | None = None, temperature: float | None = None,
             extra: dict | None = None) -> None:
    for element_id, value in (("chat-max-tokens", max_tokens), ("chat-temperature", temperature),
                              ("chat-extra", None if extra is None else json.dumps(extra))):
        box = driver.find_element(By.ID, element_id)
        box.clear()
        if value is not None:
            box.send_keys(str(value))


def say(driver, text: str, role: str = "user") -> dict:
    """Send one message; wait until the answer ends (or the request is refused); the answer as the page
    shows it."""
    before = len(driver.find_elements(By.CSS_SELECTOR, "#conversation .msg.assistant"))
    Select(driver.find_element(By.ID, "chat-role")).select_by_value(role)
    box = driver.find_element(By.ID, "chat-input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "chat-send").click()
    WebDriverWait(driver, TIMEOUT).until(lambda d: d.find_element(By.ID, "conversation").get_attribute(
        "data-state") == "idle" and not d.find_element(By.ID, "chat-send").get_attribute("disabled"))
    answers = driver.find_elements(By.CSS_SELECTOR, "#conversation .msg.assistant")
    if len(answers) == before:
        return {}
    return driver.execute_script("""
        const m = arguments[0], r = m.querySelector("details.reasoning");
        return {state: m.dataset.state, finish: m.dataset.finish,
                content: m.querySelector(".content").textContent,
                reasoning: r.hidden ? null : r.querySelector(".reasoning-text").textContent, open: r.open,
                summary: r.querySelector("summary").textContent,
                calls: [...m.querySelectorAll(".tool-call")].map(c => [c.querySelector(".name").textContent,
                                                                      c.querySelector(".arguments").textContent])};
        """, answers[-1])


def sent(driver) -> dict:
    return json.loads(driver.execute_script("return document.getElementById('chat-request-body').textContent;"))


def direct(url: str, body: dict) -> dict:
    """The route's non-streamed answer to ``body``: the reference the page is held to."""
    body = {k: v for k, v in body.items() if k != "stream"}
    reply = requests.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    assert "choices" in reply, reply
    return reply["choices"][0]


def test_a_two_message_conversation(browser, chat_url, name):
    open_chat(browser, chat_url)
    settings(browser, max_tokens=6, temperature=0, extra=NO_THINKING)
    first = say(browser, "Hello there")
    body = sent(browser)
    assert body["stream"] is True and body["model"] == name
    assert body["messages"] == [{"role": "user", "content": "Hello there"}]
    reference = direct(chat_url, body)
    assert first["state"] == "done" and first["finish"] == reference["finish_reason"]
    assert first["content"] == reference["message"]["content"]

    second = say(browser, "And then?")
    body = sent(browser)
    assert body["messages"] == [{"role": "user", "content": "Hello there"},
                                {"role": "assistant", "content": first["content"]},
                                {"role": "user", "content": "And then?"}]
    assert second["content"] == direct(chat_url, body)["message"]["content"]
    roles = browser.execute_script(
        "return [...document.querySelectorAll('#conversation .msg')].map(m => m.className);")
    assert roles == ["msg user", "msg assistant", "msg user", "msg assistant"]
    browser.find_element(By.ID, "chat-clear").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#conversation .msg") == []
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]  # e.g. the page's CSP


def test_reasoning_is_shown_in_a_collapsed_block(browser, chat_url, chat_model):
    open_chat(browser, chat_url)
    think = marker_ids(chat_model)["<think>"]
    settings(browser, max_tokens=24, temperature=1.0,
             extra={"logit_bias": {str(think): 30}, "thinking_budget": 5, "seed": 7})
    answer = say(browser, "What is the weather in Paris?")
    reference = direct(chat_url, sent(browser))["message"]
    assert reference["reasoning_content"]  # the bias makes the model think: the block has something to show
    assert answer["reasoning"] == reference["reasoning_content"]
    assert answer["content"] == reference["content"]
    assert answer["open"] is False and answer["summary"].startswith("Reasoning (")
    # the reasoning is not sent back: the next turn carries the answer only
    say(browser, "ok")
    assert sent(browser)["messages"][1] == {"role": "assistant", "content": reference["content"]}


def test_tool_calls_are_shown_and_answered(browser, chat_url):
    open_chat(browser, chat_url)
    browser.find_element(By.ID, "chat-clear").click()
    settings(browser, max_tokens=120, temperature=1.0,
             extra={"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "seed": 3,
                    **NO_THINKING})
    answer = say(browser, "Weather?")
    reference = direct(chat_url, sent(browser))
    calls = reference["message"]["tool_calls"]
    assert answer["finish"] == reference["finish_reason"] == "tool_calls"
    assert answer["calls"] == [[c["function"]["name"], c["function"]["arguments"]] for c in calls]
    settings(browser, max_tokens=4, temperature=0, extra={"tools": TOOLS, **NO_THINKING})
    say(browser, '{"sky": "clear"}', role="tool")
    messages = sent(browser)["messages"]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[2] == {"role": "tool", "tool_call_id": messages[1]["tool_calls"][0]["id"],
                           "content": '{"sky": "clear"}'}


def test_a_refused_message_shows_the_field_and_stays_out_of_the_conversation(browser, chat_url):
    open_chat(browser, chat_url)
    browser.find_element(By.ID, "chat-clear").click()
    settings(browser, extra={"temperature": -1})
    assert say(browser, "Hi") == {}
    banner = browser.find_element(By.ID, "chat-error")
    assert banner.is_displayed() and "400 (temperature)" in banner.text
    assert browser.find_elements(By.CSS_SELECTOR, "#conversation .msg") == []
    assert browser.find_element(By.ID, "chat-input").get_attribute("value") == "Hi"
    settings(browser, extra=None)
    browser.find_element(By.ID, "chat-extra").send_keys("[1]")
    assert say(browser, "Hi") == {}
    assert "must be a JSON object" in browser.find_element(By.ID, "chat-error").text
