"""Tool calls on the default model (SmolLM2-135M-Instruct, whose chat template has no tool syntax) in the
generic format, through a real socket with the official ``openai`` client: required, named (streamed), auto,
a two-turn tool round trip, /v1/responses function tools, /info; and the bar: 100 seeded streamed calls whose
joined arguments equal the non-streamed ones and follow the tool's schema (jsonschema). Every answer is also
read independently from the raw generated text (the logprobs' tokens joined, parsed with json)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def url(live_servers, default_model_dir):
    """The default model with room for the tools' system message (the session engine takes 200 tokens)."""
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=512, max_input_tokens=440, max_batch_size=4, max_iter_times=64,
                          block_size=64, prefill_chunk=64, window_buckets=(512,), batch_buckets=(1, 4))
    with Engine(default_model_dir, config) as engine:
        yield live_servers.start(engine)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(url):
    return requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def raw_answer(url: str, body: dict) -> tuple[dict, dict]:
    """(the raw generated text read as JSON, independently of the server's parser; the reply's choice)."""
    reply = requests.post(url + "/v1/chat/completions", json={**body, "logprobs": True}, timeout=300).json()
    assert "choices" in reply, reply
    choice = reply["choices"][0]
    return json.loads("".join(t["token"] for t in choice["logprobs"]["content"])), choice


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_info_shows_the_generic_format(url):
    assert requests.get(url + "/info", timeout=30).json()["mindserve"]["tool_call_format"] == {
        "format": "generic", "source": "template"}


def test_required_is_a_call_that_follows_its_schema(client, url, model):
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = calls_of(choice.message)
    jsonschema.validate(arguments, SCHEMAS[name])
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
    raw, _ = raw_answer(url, {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                              "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0})
    assert raw == {"tool_calls": [{"name": name, "arguments": arguments}]}


def test_a_named_call_streams_the_arguments_of_the_non_streamed_call(client, model):
    kwargs = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": WEATHER_CALL, "max_tokens": 40,
              "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = joined_stream(client, kwargs)
    assert whole.finish_reason == "tool_calls" == streamed["finish_reason"]
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert streamed["calls"] == expected and expected[0][0] == "get_weather" and streamed["content"] == ""
    jsonschema.validate(json.loads(expected[0][1]), WEATHER)


def test_auto_calls_or_answers_as_the_raw_text_says(client, url, model):
    for ask in (ASK, [{"role": "user", "content": "Say hello to Ann."}]):
        body = {"model": model, "messages": ask, "tools": TOOLS, "max_tokens": 48, "temperature": 0,
                "parallel_tool_calls": False}
        raw, choice = raw_answer(url, body)
        message = choice["message"]
        if "response" in raw:  # a text answer: its text, the JSON wrapper gone
            assert message["content"] == raw["response"] and "tool_calls" not in message
            assert choice["finish_reason"] == "stop"
        else:
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
                == [(c["name"], c["arguments"]) for c in raw["tool_calls"]]
            assert choice["finish_reason"] == "tool_calls" and message["content"] is None
        reply = client.chat.completions.create(**{k: v for k, v in body.items() if k != "model"}, model=model)
        assert (reply.choices[0].message.content, calls_of(reply.choices[0].message)) == (
            message["content"], [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                 for c in message.get("tool_calls") or ()])


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_round_trip(client, model, stream):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=WEATHER_CALL,
                                           max_tokens=40, temperature=0).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    conversation = [*ASK, first.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    kwargs = {"model": model, "messages": conversation, "tools": TOOLS, "max_tokens": 40, "temperature": 0}
    second = client.chat.completions.create(**kwargs, tool_choice="none").choices[0]
    assert second.finish_reason in ("stop", "length") and not second.message.tool_calls
    assert second.message.content and "tool_results" not in second.message.content
    if stream:  # auto on the second turn: the answer streams as content deltas (or as calls), never as JSON
        got = joined_stream(client, {**kwargs, "tool_choice": "auto", "parallel_tool_calls": False})
        whole = client.chat.completions.create(**kwargs, tool_choice="auto", parallel_tool_calls=False).choices[0]
        assert got["content"] == (whole.message.content or "")
        assert got["calls"] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert not got["content"].startswith('{"response"')


def test_responses_function_tools_take_the_generic_format(client, model):
    reply = client.responses.create(model=model, input="What is the weather in Paris?", max_output_tokens=40,
                                    tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}],
                                    tool_choice="required", temperature=0)
    [item] = reply.output
    assert item.type == "function_call" and item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), WEATHER)


def test_a_hundred_seeded_streams_join_to_their_bodies(client, model):
    """The bar: sampled (temperature 0.9, seeds 1..100), streamed and not, named and required calls; four pairs at
    a time (the engine batches them: a row's tokens do not depend on its batch)."""
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        complete = sum(pool.map(lambda seed: seeded_pair(client, model, seed), range(1, 101)))
    print(f"100 seeded pairs in {time.monotonic() - started:.0f} s, {complete} complete calls")
    assert complete >= 90  # a call cut by max_tokens (finish_reason length) is not held to its schema


def seeded_pair(client: openai.OpenAI, model: str, seed: int) -> bool:
    """One seed's call, whole and streamed: the same calls; True if it completed (each call then follows its
    tool's schema)."""
    kwargs = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 32, "temperature": 0.9,
              "seed": seed, "tool_choice": WEATHER_CALL if seed % 2 == 0 else "required",
              "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = joined_stream(client, kwargs)
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert streamed["calls"] == expected, seed
    assert whole.finish_reason == streamed["finish_reason"] and streamed["content"] == ""
    if whole.finish_reason != "tool_calls":
        return False
    for name, arguments in expected:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    return True


def joined_stream(client: openai.OpenAI, kwargs: dict) -> dict:
    """The stream's deltas joined by the client's own types: content, [(name, arguments)], finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or ():
                if piece.id is not None:
                    assert piece.index not in calls and piece.type == "function"
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content, "calls": [tuple(calls[i]) for i in sorted(calls)], "finish_reason": finish}
