"""Tool calling and reasoning on /v1/chat/completions, on a tiny model with a Qwen3-like template
(tests/support/tiny_chat_model.py), through a real socket: the official ``openai`` client, unmodified;
raw streams checked against the bodies; every parsed call and reasoning checked against an independent
reading of the raw text (written here, with regular expressions and json)."""
from __future__ import annotations

import json

import requests
import jsonschema
import openai
import pytest

from service.validation import default_schemas
from tests.support.http import parse_sse
from tests.support.tiny_chat_model import independent_parse, marker_ids

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK, "strict": True}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
STREAM_SCHEMA = default_schemas().validator("openai_chat_chunk")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(chat_url):
    return openai.OpenAI(base_url=chat_url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)


def model_name(url: str) -> str:
    return requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


# --- an independent reading of the raw output -----------------------------------------------------------

def raw_text(url: str, body: dict) -> str:
    """(the raw generated text, the reply): the text joined from the reply's per-token logprobs entries, which
    the output parser does not touch."""
    reply = post(url, {**body, "logprobs": True}).json()
    assert "choices" in reply, reply
    return "".join(t["token"] for t in reply["choices"][0]["logprobs"]["content"]), reply


# --- the bars --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_enforced_calls_equal_an_independent_parse_and_follow_the_schema(chat_url, choice):
    name = model_name(chat_url)
    for seed in range(5):
        body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "seed": seed + 1,
                "temperature": 1.0, "max_tokens": 60, "logit_bias": {"2": 4}, **NO_THINKING}
        raw, reply = raw_text(chat_url, body)
        choice0 = reply["choices"][0]
        _, content, calls = independent_parse(raw)
        assert choice0["finish_reason"] == "tool_calls", raw
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
               for c in choice0["message"]["tool_calls"]]
        assert got == calls and (choice0["message"]["content"] or "") == content
        for tool, arguments in got:
            jsonschema.validate(arguments, SCHEMAS[tool])
            assert isinstance(choice, str) or tool == "get_weather"
        assert all(c["id"].startswith("call_") for c in choice0["message"]["tool_calls"])


def test_reasoning_equals_an_independent_parse_and_is_counted(chat_url, chat_model):
    """Thinking on: the output opens with <think> (logit_bias pushes the model to it), the budget closes it."""
    ids = marker_ids(chat_model)
    body = {"model": model_name(chat_url), "messages": ASK, "seed": 7, "max_tokens": 40, "thinking_budget": 6,
            "logit_bias": {str(ids["<think>"]): 30}, "temperature": 1.0}
    raw, reply = raw_text(chat_url, body)
    reasoning, content, _ = independent_parse(raw)
    message = reply["choices"][0]["message"]
    assert raw.startswith("<think>") and "</think>" in raw
    assert message["reasoning_content"] == (reasoning or None) and message["content"] == content
    tokens = [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]
    inside = tokens[1:tokens.index("</think>")]
    assert len(inside) == 6  # the budget: six tokens of thought, then </think> was forced
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == tokens.index("</think>") + 1


def test_thinking_off_through_chat_template_kwargs(chat_url):
    reply = post(chat_url, {"model": model_name(chat_url), "messages": ASK, "seed": 1, "max_tokens": 8,
                            **NO_THINKING}).json()
    assert reply["choices"][0]["message"]["reasoning_content"] is None
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_a_hundred_streams_join_to_their_bodies(chat_url):
    name, finished = model_name(chat_url), 0
    for seed in range(100):
        choice = ["required", "auto", {"type": "function", "function": {"name": "get_time"}}][seed % 3]
        body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "seed": seed + 1,
                "temperature": 1.0, "max_tokens": 120, "logit_bias": {"386": 8, "2": 6}, **NO_THINKING}
        whole = post(chat_url, body).json()["choices"][0]
        streamed = _joined_stream(chat_url, body)
        calls = whole["message"].get("tool_calls", [])
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == streamed["calls"], seed
        assert (whole["message"]["content"] or "") == streamed["content"]
        assert whole["finish_reason"] == streamed["finish_reason"]
        finished += whole["finish_reason"] == "tool_calls"
        for call in calls if whole["finish_reason"] == "tool_calls" else ():  # (not a call cut by max_tokens)
            if choice != "auto" or call["function"]["name"] == "get_time":  # enforced: required, named, strict
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert finished >= 50  # most end with their calls complete (the rest at max_tokens)


def _joined_stream(url: str, body: dict) -> dict:
    text = requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120).text
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    events = parse_sse(text[:-len("data: [DONE]\n\n")])
    for event in events:
        STREAM_SCHEMA.validate(event)
    names, arguments, content, finish = {}, {}, "", None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or ():
                if "id" in piece:
                    assert piece["index"] not in names and piece["function"]["arguments"] == ""
                    names[piece["index"]] = piece["function"]["name"]
                arguments[piece["index"]] = arguments.get(piece["index"], "") + piece["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return {"calls": [(names[i], arguments[i]) for i in sorted(names)], "content": content, "finish_reason": finish}


# --- the official client -----------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_two_turn_tool_conversation(client, chat_url, choice, stream):
    name = model_name(chat_url)
    extra = {"extra_body": NO_THINKING, "seed": 3, "temperature": 1.0, "max_tokens": 160,
             "logit_bias": {"386": 40, "2": 9}}  # auto: the model opens a call at once; strict get_time keeps it valid
    first = _create(client, stream, model=name, messages=ASK, tools=TOOLS, tool_choice=choice,
                    parallel_tool_calls=False, **extra)
    assert first["finish_reason"] == "tool_calls"
    call = first["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    conversation = ASK + [{"role": "assistant", "content": first["content"], "tool_calls": first["tool_calls"]},
                          {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    second = _create(client, stream, model=name, messages=conversation, tools=TOOLS, tool_choice="none",
                     extra_body=NO_THINKING, seed=4, max_tokens=8)
    assert second["finish_reason"] in ("stop", "length") and "tool_calls" not in second
    assert isinstance(second["content"], str)


def _create(client: openai.OpenAI, stream: bool, **kwargs) -> dict:
    """One turn as {content, tool_calls, finish_reason}, the stream's pieces joined by the client's own types."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        out = {"content": choice.message.content, "finish_reason": choice.finish_reason}
        if choice.message.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in choice.message.tool_calls]
        return out
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or ():
                entry = calls.setdefault(piece.index, {"id": piece.id, "type": "function",
                                                       "function": {"name": piece.function.name, "arguments": ""}})
                entry["function"]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    out = {"content": content or None, "finish_reason": finish}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


# --- errors ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_fields_are_400s_naming_the_field(chat_url, change, param):
    body = {"model": model_name(chat_url), "messages": ASK, "tools": TOOLS, **change}
    reply = post(chat_url, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"

