"""/v1/messages with tools and thinking, on the tiny model with a Qwen3-like template (Hermes tool calls,
``<think>`` reasoning; tests/support/tiny_chat_model.py), through a real socket, with the official ``anthropic``
client unmodified: a ``tool_use`` → ``tool_result`` → answer round trip (non-streamed and streamed), each
turn checked against the chat route on the same conversation written by hand as chat messages (greedy) and the
call against an independent reading of the raw text; thinking blocks from the reasoning parser, the budget
honoured. The template here opens ``<think>`` in the generation prompt when thinking is on (as reasoning
templates do), so the output starts inside the reasoning block."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
import requests

from tests.support.tiny_chat_model import QWEN3_LIKE_TEMPLATE, independent_parse

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
OFF = {"type": "disabled"}
CHAT_OFF = {"enable_thinking": False}
GREEDY = {"temperature": 0}
OPENS_THINKING = ("{%- if enable_thinking is defined and enable_thinking is false %}",
                  "{%- if enable_thinking is defined and enable_thinking is true %}{{- '<think>\\n' }}{%- endif %}"
                  "{%- if enable_thinking is defined and enable_thinking is false %}")


@pytest.fixture(scope="module")
def url(live_servers, chat_model):
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    config_file = chat_model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    assert config["chat_template"] == QWEN3_LIKE_TEMPLATE
    config["chat_template"] = QWEN3_LIKE_TEMPLATE.replace(*OPENS_THINKING)
    config_file.write_text(json.dumps(config))
    engine_config = EngineConfig(max_seq_len=1536, max_input_tokens=1400, max_batch_size=4, max_iter_times=64,
                                 block_size=64, prefill_chunk=256, window_buckets=(1536,), batch_buckets=(1, 4))
    with Engine(chat_model, engine_config) as engine:
        yield live_servers.start(engine)


@pytest.fixture(scope="module")
def name(url) -> str:
    return requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)


def chat(url: str, body: dict) -> tuple[str, dict]:
    """(the raw generated text, the reply) of a greedy chat request: the text joined from the per-token
    logprobs, which the output parser does not touch."""
    reply = requests.post(url + "/v1/chat/completions", json={**body, "logprobs": True, "temperature": 0},
                          timeout=120).json()
    assert "choices" in reply, reply
    return "".join(t["token"] for t in reply["choices"][0]["logprobs"]["content"]), reply


def turn(client: anthropic.Anthropic, stream: bool, **kwargs) -> anthropic.types.Message:
    if not stream:
        return client.messages.create(**kwargs, extra_body=GREEDY)
    with client.messages.stream(**kwargs, extra_body=GREEDY) as events:
        for _ in events:
            pass
        return events.get_final_message()


def without_ids(message: anthropic.types.Message) -> dict:
    out = message.model_dump(exclude={"id"})
    for block in out["content"]:
        block.pop("id", None)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_then_tool_result_then_answer(client, url, name, stream):
    first = turn(client, stream, model=name, max_tokens=60, messages=ASK, tools=TOOLS, thinking=OFF,
                 tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use" and first.content[-1].type == "tool_use"
    call = first.content[-1]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    raw, reply = chat(url, {"model": name, "messages": ASK, "tools": CHAT_TOOLS, "max_tokens": 60,
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                            "chat_template_kwargs": CHAT_OFF})
    _, content, calls = independent_parse(raw)
    assert calls == [("get_weather", call.input)]
    assert [b.text for b in first.content if b.type == "text"] == ([content] if content else [])
    assert first.usage.input_tokens == reply["usage"]["prompt_tokens"]
    if stream:
        assert without_ids(first) == without_ids(turn(client, False, model=name, max_tokens=60, messages=ASK,
                                                      tools=TOOLS, thinking=OFF,
                                                      tool_choice={"type": "tool", "name": "get_weather"}))

    conversation = ASK + [{"role": "assistant", "content": first.content},  # as an agent sends it back
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": "sunny, 21 C"}]}]
    second = turn(client, stream, model=name, max_tokens=8, messages=conversation, tools=TOOLS, thinking=OFF,
                  tool_choice={"type": "none"})
    chat_conversation = ASK + [
        {"role": "assistant", "content": content or None, "tool_calls": [{
            "id": call.id, "type": "function", "function": {"name": "get_weather",
                                                            "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    _, answer = chat(url, {"model": name, "messages": chat_conversation, "tools": CHAT_TOOLS, "tool_choice": "none",
                           "max_tokens": 8, "chat_template_kwargs": CHAT_OFF})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]
    assert second.content[0].text == answer["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == answer["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model=name, messages=conversation, tools=TOOLS, thinking=OFF,
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == second.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_blocks_hold_the_reasoning_within_the_budget(client, url, name, stream):
    message = turn(client, stream, model=name, max_tokens=20, messages=ASK,
                   thinking={"type": "enabled", "budget_tokens": 5})
    raw, reply = chat(url, {"model": name, "messages": ASK, "max_tokens": 20, "thinking_budget": 5,
                            "chat_template_kwargs": {"enable_thinking": True}})
    # the budget: five tokens of thought, then </think> was forced (six reasoning tokens)
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6 and "</think>" in raw
    reasoning, content, _ = independent_parse("<think>" + raw)
    assert message.content[0].type == "thinking" and message.content[0].thinking == reasoning
    assert message.content[0].signature == ""
    assert [b.text for b in message.content[1:]] == ([content] if content else [])
    assert message.content[0].thinking == reply["choices"][0]["message"]["reasoning_content"]
    assert message.usage.output_tokens == reply["usage"]["completion_tokens"]


def test_thinking_disabled_gives_no_thinking_block(client, name):
    message = client.messages.create(model=name, max_tokens=8, messages=ASK, thinking=OFF, extra_body=GREEDY)
    assert all(block.type == "text" for block in message.content)


def test_tool_errors_name_the_messages_fields(client, name):
    cases = [({"tools": [{"name": "f", "input_schema": {"type": "objectx"}}]}, "tools[0].input_schema does not"),
             ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 'function "nope", which is not in'),
             ({"tool_choice": {"type": "any"}}, "tool_choice is not allowed: any and tool need tools"),
             ({"tools": TOOLS + TOOLS}, "tools[1].name"),
             ({"messages": ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                                    "name": "get_weather", "input": {}}]}]},
              "messages[1].content[0] is a tool_use in the last message")]
    for change, says in cases:
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(**{"model": name, "max_tokens": 4, "messages": ASK, **change})
        assert says in caught.value.api_message, caught.value.api_message
