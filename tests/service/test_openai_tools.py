"""Tool calling and reasoning in the OpenAI dialect, without a model: the request fields → options, grammar
and template variables; a generated text → the body and the stream, checked against the schemas and
against each other (the stream's pieces joined equal the body)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from backends.types import FinishReason, GenerationResult, Token, TokenEvent
from service.dialects.openai import ChunkRenderer, InvalidRequest, OpenAIStream, parse_openai_request, render_completion
from service.validation import default_schemas
from tests.support.tiny_chat_model import QWEN3_LIKE_TEMPLATE, TemplateBackend
from tests.support.tiny_checkpoint import CHAT_TEMPLATE

SCHEMAS = default_schemas()
MODEL = "m"
ASK = [{"role": "user", "content": "weather?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop", "strict": True}}]


QWEN = TemplateBackend(QWEN3_LIKE_TEMPLATE, MODEL)
PLAIN = TemplateBackend(CHAT_TEMPLATE, MODEL)


def chat(backend: TemplateBackend = QWEN, **fields: Any):
    body = {"model": MODEL, "messages": ASK, **fields}
    return parse_openai_request("chat", body, SCHEMAS, MODEL, backend=backend)


def result(text: str, finish: FinishReason = FinishReason.EOS_TOKEN, pieces: list[str] | None = None):
    pieces = pieces if pieces is not None else list(text)
    tokens = tuple(Token(i, p, -0.5, False) for i, p in enumerate(pieces))
    return GenerationResult(text, finish, 5, len(tokens), 1, tokens)


# --- request ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice, kinds", [
    (None, None), ("none", None), ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "tool_calls"),
])
def test_tool_choice_becomes_the_grammar(choice, kinds):
    tools = [TOOLS[0]]
    req = chat(tools=tools, tool_choice=choice)
    grammar = req.params.grammar
    assert (grammar.kind if grammar else None) == kinds
    if grammar is not None:
        spec = json.loads(grammar.value)
        assert [name for name, _ in spec["tools"]] == ["get_weather"] and spec["syntax"] == "hermes"
        assert spec["parallel"] == (choice == "required")


def test_strict_tools_constrain_auto_calls():
    spec = json.loads(chat(tools=TOOLS).params.grammar.value)
    assert spec["optional"] and [name for name, _ in spec["tools"]] == ["noop"]


def test_tools_and_kwargs_reach_the_template():
    req = chat(tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    prompt = req.render_prompt(QWEN)
    assert '"name": "get_weather"' in prompt and prompt.endswith("<think>\n\n</think>\n\n")
    assert req.chat.thinking_off and not req.chat.thinking
    assert json.loads(chat(tools=TOOLS, tool_choice="required").params.grammar.value)["reasoning"]
    spec = json.loads(chat(tools=TOOLS, tool_choice="required", chat_template_kwargs={"enable_thinking": False})
                      .params.grammar.value)
    assert not spec["reasoning"]  # thinking off: no reasoning block before the calls


def test_a_tool_conversation_goes_back_to_the_template():
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    prompt = chat(messages=messages, tools=TOOLS).render_prompt(QWEN)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\nrain\n</tool_response>" in prompt


def test_thinking_budget_goes_to_the_engine_only_for_a_model_that_reasons():
    assert chat(thinking_budget=5).params.thinking_budget == 5
    assert chat(PLAIN, thinking_budget=5).params.thinking_budget is None


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        chat(**fields)
    assert caught.value.param == param, str(caught.value)


def test_a_model_without_a_tool_format_gets_the_generic_one_and_none_refuses_tools():
    assert chat(PLAIN, tools=TOOLS).chat.generic  # tests/service/test_generic_tools.py has the rest
    assert chat(PLAIN, tools=TOOLS, tool_choice="none").params.grammar is None
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS}
    with pytest.raises(InvalidRequest) as caught:
        parse_openai_request("chat", body, SCHEMAS, MODEL, backend=PLAIN, formats=("none", "auto"))
    assert caught.value.param == "tools" and "toolCallFormat" in str(caught.value)


# --- response ----------------------------------------------------------------------------------------------

OUTPUT = ('<think>\nweather needs a tool\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Oslo"}}\n</tool_call>')


def body_and_stream(req, res: GenerationResult, include_usage: bool = False) -> tuple[dict, list[dict]]:
    body = render_completion(req, res, response_id="chatcmpl-x", model=MODEL)
    SCHEMAS.validate("openai_chat_response", body)
    stream = OpenAIStream(req, ChunkRenderer(req, response_id="chatcmpl-x", model=MODEL))
    events = []
    for i, token in enumerate(res.tokens):
        events += stream.on_token(TokenEvent(token, i, token.text, last=i == len(res.tokens) - 1))
    events += stream.on_result(res)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e != "data: [DONE]\n\n"]
    for chunk in chunks:
        SCHEMAS.validate("openai_chat_chunk", chunk)
    return body, chunks


def joined(chunks: list[dict]) -> dict:
    out: dict[str, Any] = {"content": "", "reasoning_content": "", "calls": {}, "finish_reason": None}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            out["content"] += delta.get("content") or ""
            out["reasoning_content"] += delta.get("reasoning_content") or ""
            for piece in delta.get("tool_calls") or ():
                call = out["calls"].setdefault(piece["index"], {"name": piece["function"].get("name"), "arguments": ""})
                call["arguments"] += piece["function"]["arguments"]
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


@pytest.mark.parametrize("split", [1, 2, 3, 7, 1000])
def test_body_and_stream_agree_whatever_the_tokens(split):
    pieces = [OUTPUT[i:i + split] for i in range(0, len(OUTPUT), split)]
    req = chat(tools=TOOLS, stream_options=None)
    body, chunks = body_and_stream(req, result(OUTPUT, pieces=pieces))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "weather needs a tool" and message["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"city": "Oslo"}')]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    streamed = joined(chunks)
    assert streamed["content"] == message["content"] and streamed["reasoning_content"] == message["reasoning_content"]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert streamed["finish_reason"] == "tool_calls"
    reasoning_end = OUTPUT.index("</think>") + len("</think>")
    expected = len([p for i, p in enumerate(pieces) if sum(map(len, pieces[:i])) < reasoning_end])
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == expected


def test_a_call_cut_by_the_length_cap_finishes_as_length():
    text = OUTPUT[:-20]
    body, chunks = body_and_stream(chat(tools=TOOLS), result(text, FinishReason.LENGTH))
    assert body["choices"][0]["finish_reason"] == "length" == joined(chunks)["finish_reason"]


def test_include_usage_counts_reasoning_in_the_stream():
    req = chat(tools=TOOLS, stream=True, stream_options={"include_usage": True})
    _, chunks = body_and_stream(req, result(OUTPUT))
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == OUTPUT.index("</think>") + 8


def test_a_model_without_reasoning_is_unaffected():
    text = "  <think>not parsed</think> raw  "
    body, chunks = body_and_stream(chat(PLAIN), result(text))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert "completion_tokens_details" not in body["usage"]
    assert joined(chunks)["content"] == text and joined(chunks)["reasoning_content"] == ""


def test_the_server_config_overrides_the_templates_formats():
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    llama = parse_openai_request("chat", body, SCHEMAS, MODEL, backend=QWEN, formats=("llama3_json", "none"))
    spec = json.loads(llama.params.grammar.value)
    assert spec["syntax"] == "llama3_json" and not spec["reasoning"] and llama.chat.fmt.reasoning is None
    with pytest.raises(InvalidRequest):
        parse_openai_request("chat", body, SCHEMAS, MODEL, backend=QWEN, formats=("none", "auto"))
