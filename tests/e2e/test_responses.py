"""/v1/responses on the tiny Qwen3-like chat model (tests/support/tiny_chat_model.py), through a real socket:
the official ``openai`` client's ``responses.create`` and ``responses.stream``, unmodified; the raw event
stream checked against the schemas and its own rules (numbering, order, deltas joined equal the done
texts); the output checked against the chat route (greedy, the same conversation written by hand as chat
messages) and against an independent reading of the raw text (regular expressions and json, here)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

from service.validation import default_schemas
from tests.support.tiny_chat_model import independent_parse, marker_ids

pytestmark = pytest.mark.slow

SCHEMAS = default_schemas()
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER,
                                              "strict": True}}
QUESTION = "What is the weather in Paris?"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def name(chat_url) -> str:
    return requests.get(chat_url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(chat_url):
    return openai.OpenAI(base_url=chat_url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_raw(url: str, body: dict) -> tuple[str, dict]:
    """(the raw generated text, the reply) of a chat request: the text joined from the per-token logprobs."""
    reply = requests.post(url + "/v1/chat/completions", json={**body, "logprobs": True}, timeout=120).json()
    assert "choices" in reply, reply
    return "".join(t["token"] for t in reply["choices"][0]["logprobs"]["content"]), reply


def summary(output: list[dict]) -> list[tuple]:
    """An output as (type, text or (name, arguments)) in order, ids aside."""
    out = []
    for item in output:
        if item["type"] == "function_call":
            out.append(("function_call", item["name"], json.loads(item["arguments"])))
        else:
            out.append((item["type"], "".join(p["text"] for p in item["content"])))
    return out


def raw_events(url: str, body: dict) -> list[dict]:
    """A stream's events, each checked against the event schema and its SSE name."""
    reply = requests.post(url + "/v1/responses", json={**body, "stream": True}, timeout=120)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/event-stream"), reply.text
    text = reply.content.decode("utf-8")
    assert text.endswith("\n\n")
    events = []
    for frame in text[:-2].split("\n\n"):
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        SCHEMAS.validate("openai_responses_event", event, root="event")
        events.append(event)
    return events


def check_sequence(events: list[dict]) -> dict:
    """The stream's rules, read from OpenAI's reference: numbered 0.., created and in_progress first, one
    final event last, each item added before its deltas and done after them, the deltas joined equal to the
    done texts and to the final output. Returns the final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    SCHEMAS.validate("openai_responses_response", final, root="response")
    open_items: dict[int, str] = {}
    texts: dict[int, str] = {}
    done: list[dict] = []
    for event in events[2:-1]:
        kind, index = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            assert index == len(done) and not open_items, event
            open_items[index] = event["item"]["id"]
            texts[index] = ""
        elif kind == "response.output_item.done":
            assert open_items.pop(index) == event["item"]["id"]
            done.append(event["item"])
        else:
            assert open_items.get(index) == event["item_id"], event
            if kind.endswith(".delta"):
                texts[index] += event["delta"]
            elif kind in ("response.output_text.done", "response.reasoning_text.done"):
                assert event["text"] == texts[index]
            elif kind == "response.function_call_arguments.done":
                assert event["arguments"] == texts[index]
    assert not open_items and done == final["output"]
    return final


# --- create: the chat route's answer, as a response ------------------------------------------------------

def test_create_answers_as_the_chat_route_does(client, chat_url, name):
    response = client.responses.create(model=name, input=QUESTION, instructions="Be brief.", max_output_tokens=12,
                                       temperature=0, extra_body=NO_THINKING)
    raw, chat = chat_raw(chat_url, {"model": name, "max_tokens": 12, "temperature": 0, **NO_THINKING, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]})
    _, content, _ = independent_parse(raw)
    assert response.output_text == content == chat["choices"][0]["message"]["content"]
    assert response.status == ("incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed")
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"] == 12
    assert response.store is False and response.instructions == "Be brief."
    body = requests.post(chat_url + "/v1/responses", json={"model": name, "input": QUESTION}, timeout=120).json()
    SCHEMAS.validate("openai_responses_response", body, root="response")


def test_stream_events_follow_the_sequence_and_equal_the_body(client, chat_url, name):
    body = {"model": name, "input": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_output_tokens": 20, **NO_THINKING}
    final = check_sequence(raw_events(chat_url, body))
    whole = requests.post(chat_url + "/v1/responses", json=body, timeout=120).json()
    assert summary(final["output"]) == summary(whole["output"])
    # the same counts; only the prefix-cache hit may differ, the second request finding what the first one left
    cached = [u.pop("input_tokens_details")["cached_tokens"] for u in (final["usage"], whole["usage"])]
    assert final["usage"] == whole["usage"] and all(0 <= c <= whole["usage"]["input_tokens"] for c in cached)
    with client.responses.stream(model=name, input=QUESTION, temperature=0, max_output_tokens=20,
                                 extra_body=NO_THINKING) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response() if final["status"] == "completed" else None
    assert "".join(deltas) == "".join(p["text"] for i in whole["output"] for p in i["content"])
    if streamed is not None:
        assert streamed.output_text == "".join(deltas)


# --- tools: a two-turn conversation with the official client ---------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_two_turn_tool_conversation(client, chat_url, name, choice, stream):
    asked = [{"role": "user", "content": QUESTION}]
    first = _respond(client, stream, model=name, input=asked, tools=[TOOL], tool_choice=choice, temperature=1.0,
                     extra_body={"seed": 5, **NO_THINKING}, max_output_tokens=60)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the same turn on the chat route, read independently: the same calls
    raw, _ = chat_raw(chat_url, {"model": name, "messages": asked, "tools": [CHAT_TOOL], "max_tokens": 60,
                                 "tool_choice": choice if isinstance(choice, str) else
                                 {"type": "function", "function": {"name": "get_weather"}},
                                 "temperature": 1.0, "seed": 5, **NO_THINKING})
    assert [(c.name, json.loads(c.arguments)) for c in calls] == independent_parse(raw)[2]
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"sky": "clear"}'} for c in calls]
    conversation = [*asked, *first.output, *results]  # the output items as the client returns them
    second = _respond(client, stream, model=name, input=conversation, tools=[TOOL], tool_choice="none",
                      max_output_tokens=8, temperature=0, extra_body=NO_THINKING)
    assert [item.type for item in second.output] == ["message"]
    chat_messages = asked + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls]}] + [{"role": "tool", "tool_call_id": c.call_id, "content": '{"sky": "clear"}'}
                             for c in calls]
    raw, _ = chat_raw(chat_url, {"model": name, "messages": chat_messages, "tools": [CHAT_TOOL], "max_tokens": 8,
                                 "tool_choice": "none", "temperature": 0, **NO_THINKING})
    assert second.output_text == independent_parse(raw)[1]


def _respond(client: openai.OpenAI, stream: bool, **kwargs):
    if not stream:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as events:
        last = None
        for last in events:
            pass
        # a response cut by max_output_tokens ends with response.incomplete, as OpenAI's
        return events.get_final_response() if last.type == "response.completed" else last.response


# --- reasoning, structured output ---------------------------------------------------------------------------

def test_reasoning_is_an_item_and_is_counted(chat_url, chat_model, name):
    ids = marker_ids(chat_model)
    body = {"model": name, "input": QUESTION, "seed": 7, "max_output_tokens": 40, "thinking_budget": 6,
            "logit_bias": {str(ids["<think>"]): 30}, "temperature": 1.0}
    whole = requests.post(chat_url + "/v1/responses", json=body, timeout=120).json()
    raw, chat = chat_raw(chat_url, {"model": name, "messages": [{"role": "user", "content": QUESTION}],
                                    **{k: v for k, v in body.items() if k not in ("input", "max_output_tokens")},
                                    "max_tokens": 40})
    reasoning, content, _ = independent_parse(raw)
    assert raw.startswith("<think>") and reasoning is not None
    kinds = summary(whole["output"])
    assert kinds[0] == ("reasoning", reasoning)
    assert [text for kind, text in kinds[1:] if kind == "message"] == [content]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == \
        chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    events = raw_events(chat_url, body)
    final = check_sequence(events)
    assert summary(final["output"]) == kinds
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning
    client = openai.OpenAI(base_url=chat_url + "/v1", api_key="none", max_retries=0, timeout=120)
    extra = {k: body[k] for k in ("seed", "thinking_budget", "logit_bias")}
    with client.responses.stream(model=name, input=QUESTION, max_output_tokens=40, temperature=1.0,
                                 extra_body=extra) as stream:
        last = None
        for last in stream:
            pass
    streamed = stream.get_final_response() if last.type == "response.completed" else last.response
    assert streamed.output[0].type == "reasoning" and streamed.output[0].content[0].text == reasoning
    assert streamed.usage.output_tokens_details.reasoning_tokens == whole["usage"]["output_tokens_details"][
        "reasoning_tokens"]


def test_text_format_json_schema_is_enforced(client, name):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model=name, input=QUESTION, max_output_tokens=40, extra_body=NO_THINKING,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


# --- refusals: 400s naming the Responses field ---------------------------------------------------------------

@pytest.mark.parametrize("change, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**TOOL, "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}]},
     "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_bad_fields_are_400s_naming_the_field(client, name, change, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": name, "input": QUESTION, **change})
    error = caught.value.body
    assert error["param"] == param and param.split("[")[0].split(".")[0] in error["message"], error
