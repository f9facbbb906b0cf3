"""The generic tool-call format in the OpenAI dialect, without a model (a template with no tool syntax,
rendered for real): the request → grammar, prompt and template variables; a generated answer → the body and
the stream (checked against the schemas and each other at every split); the config's override and /info."""
from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from backends.chat_format import tool_call_source
from backends.types import FinishReason, GenerationResult, Token, TokenEvent
from service.config import ConfigFileError, ServerSettings, load_server_config
from service.dialects.openai import ChunkRenderer, InvalidRequest, OpenAIStream, parse_openai_request, render_completion
from service.validation import default_schemas
from tests.support.tiny_chat_model import QWEN3_LIKE_TEMPLATE, TemplateBackend
from tests.support.tiny_checkpoint import CHAT_TEMPLATE

SCHEMAS = default_schemas()
MODEL = "m"
ASK = [{"role": "user", "content": "weather in Oslo?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}}]
PLAIN = TemplateBackend(CHAT_TEMPLATE, MODEL)
QWEN = TemplateBackend(QWEN3_LIKE_TEMPLATE, MODEL)


def chat(backend: TemplateBackend = PLAIN, formats: tuple[str, str] = ("auto", "auto"), **fields: Any):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, **fields}
    return parse_openai_request("chat", body, SCHEMAS, MODEL, backend=backend, formats=formats)


def spec(req) -> dict:
    assert req.params.grammar.kind == "tool_calls"
    return json.loads(req.params.grammar.value)


# --- request ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, tools, parallel, optional", [
    ({}, ["get_weather", "noop"], True, True),
    ({"parallel_tool_calls": False}, ["get_weather", "noop"], False, True),
    ({"tool_choice": "required"}, ["get_weather", "noop"], True, False),
    ({"tool_choice": {"type": "function", "function": {"name": "noop"}}}, ["noop"], False, False),
])
def test_every_answer_that_may_call_is_held_by_the_grammar(fields, tools, parallel, optional):
    grammar = spec(chat(**fields))
    assert grammar["syntax"] == "generic" and [name for name, _ in grammar["tools"]] == tools
    assert (grammar["parallel"], grammar["optional"]) == (parallel, optional)
    assert dict(grammar["tools"]).get("noop", {"type": "object"}) == {"type": "object"}


def test_the_prompt_has_our_system_message_and_not_the_tools_variable():
    req = chat(messages=[{"role": "system", "content": "Be brief."}, *ASK])
    assert "tools" not in req.chat.template_variables()
    prompt = req.render_prompt(PLAIN)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call tools.")
    assert prompt.count("<|im_start|>system") == 1 and '{"name":"get_weather","description":"Weather"' in prompt
    assert prompt.endswith("<|im_start|>user\nweather in Oslo?<|im_end|>\n<|im_start|>assistant\n")


def test_tool_choice_none_is_plain_text_without_our_message():
    req = chat(tool_choice="none")
    assert req.params.grammar is None and not req.chat.parses
    assert req.render_prompt(PLAIN) == PLAIN.apply_chat_template(
        [{"role": "user", "content": "weather in Oslo?"}], add_generation_prompt=True)


def test_a_tool_round_trip_is_rendered_for_a_template_without_tools():
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    for choice in ("auto", "none"):
        prompt = chat(messages=messages, tool_choice=choice).render_prompt(PLAIN)
        assert '<|im_start|>assistant\n{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}}]}' \
               '<|im_end|>' in prompt
        assert '<|im_start|>user\n{"tool_results":[{"tool_call_id":"call_1","name":"get_weather",' \
               '"content":"rain"}]}<|im_end|>' in prompt
        assert ("You can call tools." in prompt) == (choice == "auto")


def test_the_config_chooses_the_format():
    assert spec(chat(QWEN, ("generic", "auto"), tool_choice="required"))["syntax"] == "generic"
    assert spec(chat(QWEN, tool_choice="required"))["syntax"] == "hermes"  # native formats unchanged
    with pytest.raises(InvalidRequest) as caught:
        chat(formats=("none", "auto"))
    assert caught.value.param == "tools"
    settings = ServerSettings(tool_call_format="hermes", model_tool_call_formats=(("m", "generic"),))
    assert settings.chat_formats("m") == ("generic", "auto") and settings.chat_formats("x")[0] == "hermes"
    assert tool_call_source(CHAT_TEMPLATE) == {"format": "generic", "source": "template"}
    assert tool_call_source(QWEN3_LIKE_TEMPLATE) == {"format": "hermes", "source": "template"}
    assert tool_call_source(QWEN3_LIKE_TEMPLATE, "generic") == {"format": "generic", "source": "config"}
    assert tool_call_source(CHAT_TEMPLATE, "none") == {"format": "none", "source": "config"}


@pytest.mark.parametrize("model_key, server_key, expected", [
    (None, None, "auto"), ("generic", None, "generic"), (None, "hermes", "hermes"), ("none", "generic", "none"),
])
def test_a_model_config_entry_overrides_the_server_key(tmp_path, model_key, server_key, expected):
    entry = {"modelName": "m", "modelWeightPath": "m", **({"toolCallFormat": model_key} if model_key else {})}
    config = {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [entry]}},
              **({"ServerConfig": {"toolCallFormat": server_key}} if server_key else {})}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert load_server_config(tmp_path / "c.yaml").server.chat_formats("m") == (expected, "auto")


def test_an_unknown_format_in_the_config_names_the_key(tmp_path):
    config = {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
        {"modelName": "m", "modelWeightPath": "m", "toolCallFormat": "xml"}]}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigFileError, match="toolCallFormat"):
        load_server_config(tmp_path / "c.yaml")


def test_response_format_with_generic_tools_is_a_400_naming_it():
    with pytest.raises(InvalidRequest) as caught:
        chat(response_format={"type": "json_object"})
    assert caught.value.param == "response_format" and "generic format" in str(caught.value)


# --- response ---------------------------------------------------------------------------------------------

def body_and_stream(req, text: str, pieces: list[str], finish: FinishReason = FinishReason.EOS_TOKEN):
    tokens = tuple(Token(i, p, -0.5, False) for i, p in enumerate(pieces))
    res = GenerationResult(text, finish, 5, len(tokens), 1, tokens)
    body = render_completion(req, res, response_id="chatcmpl-x", model=MODEL)
    SCHEMAS.validate("openai_chat_response", body)
    stream = OpenAIStream(req, ChunkRenderer(req, response_id="chatcmpl-x", model=MODEL))
    events = [e for i, t in enumerate(tokens) for e in stream.on_token(TokenEvent(t, i, t.text))]
    events += stream.on_result(res)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e != "data: [DONE]\n\n"]
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        SCHEMAS.validate("openai_chat_chunk", chunk)
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or ():
            if "id" in piece:
                assert piece["type"] == "function" and piece["id"].startswith("call_")
                calls[piece["index"]] = [piece["function"]["name"], ""]
            calls[piece["index"]][1] += piece["function"]["arguments"]
        finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
    return body["choices"][0], {"content": content, "calls": [tuple(calls[i]) for i in sorted(calls)],
                                "finish_reason": finish_reason}


CALLS = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"noop","arguments":{}}]}'


@pytest.mark.parametrize("split", range(1, len(CALLS), 7))
def test_calls_are_tool_calls_in_the_body_and_the_stream(split):
    choice, streamed = body_and_stream(chat(), CALLS, [CALLS[:split], CALLS[split:]])
    message = choice["message"]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert got == [("get_weather", '{"city":"Oslo"}'), ("noop", "{}")]
    assert streamed == {"content": "", "calls": got, "finish_reason": "tool_calls"}


def test_a_text_response_is_content_without_its_wrapper():
    text = '{"response":"It rains in \\"Oslo\\".\\nTake a coat."}'
    choice, streamed = body_and_stream(chat(), text, [text[i:i + 3] for i in range(0, len(text), 3)])
    assert choice["message"] == {"role": "assistant", "content": 'It rains in "Oslo".\nTake a coat.'}
    assert choice["finish_reason"] == "stop"
    assert streamed == {"content": choice["message"]["content"], "calls": [], "finish_reason": "stop"}


def test_parallel_false_keeps_one_call_and_a_cut_call_finishes_as_length():
    choice, streamed = body_and_stream(chat(parallel_tool_calls=False), CALLS, list(CALLS))
    assert len(choice["message"]["tool_calls"]) == 1 and len(streamed["calls"]) == 1
    cut = CALLS[:30]
    choice, streamed = body_and_stream(chat(), cut, list(cut), FinishReason.LENGTH)
    assert choice["finish_reason"] == "length" == streamed["finish_reason"]
