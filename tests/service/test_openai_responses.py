"""The Responses dialect without a model: a /v1/responses body → the chat request it means (written by hand
here), errors naming the Responses fields, and a generated text → the body and the stream, checked
against the schemas and against each other at every split of the text."""
from __future__ import annotations

import json
from typing import Any

import pytest

from backends.chat_template import render_chat_template
from backends.types import FinishReason, GenerationResult, Token, TokenEvent
from service.dialects.openai import InvalidRequest
from service.dialects.openai_responses import RESPONSES, ResponsesStream
from service.dialects.openai_responses_request import chat_request, parse_responses_request
from service.validation import default_schemas
from tests.support.tiny_chat_model import QWEN3_LIKE_TEMPLATE, TemplateBackend
from tests.support.tiny_checkpoint import CHAT_TEMPLATE

SCHEMAS = default_schemas()
MODEL = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


class Context:
    def __init__(self, backend: TemplateBackend) -> None:
        self.backend = backend


QWEN = TemplateBackend(QWEN3_LIKE_TEMPLATE, MODEL)
PLAIN = TemplateBackend(CHAT_TEMPLATE, MODEL)


def parse(backend: TemplateBackend = QWEN, **fields: Any):
    return parse_responses_request({"model": MODEL, "input": "hi", **fields}, SCHEMAS, MODEL, backend=backend)


def result(text: str, finish: FinishReason = FinishReason.EOS_TOKEN, pieces: list[str] | None = None):
    pieces = pieces if pieces is not None else list(text)
    tokens = tuple(Token(i, p, -0.5, False) for i, p in enumerate(pieces))
    return GenerationResult(text, finish, 5, len(tokens), 1, tokens)


# --- request: the chat body it means ---------------------------------------------------------------------

def test_a_tool_conversation_becomes_chat_messages():
    body = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 9, "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"}, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather"}, {"type": "input_text",
                                                                                        "text": "?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see.",
                                                                      "annotations": []}]},
                {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
                {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city":"Lima"}'},
                {"type": "function_call_output", "call_id": "call_a", "output": "sun"},
                {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text",
                                                                                  "text": "rain"}]}],
            "text": {"format": {"type": "json_schema", "name": "x", "schema": WEATHER}}}
    chat, origins = chat_request(body)
    calls = [{"id": i, "type": "function", "function": {"name": "get_weather", "arguments": a}}
             for i, a in (("call_a", '{"city":"Oslo"}'), ("call_b", '{"city":"Lima"}'))]
    assert chat == {
        "model": MODEL, "max_completion_tokens": 9,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "?"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}], "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "call_a", "content": "sun"},
                     {"role": "tool", "tool_call_id": "call_b", "content": "rain"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER}}}
    assert origins == ["instructions", "input[0]", "input[2]", "input[5]", "input[6]"]
    # the translation is a valid chat body, but for the rule both schemas state: a named call and a JSON format
    # exclude each other
    assert SCHEMAS.is_valid("openai_chat_request", {k: v for k, v in chat.items() if k != "response_format"})
    assert not SCHEMAS.is_valid("openai_chat_request", chat) and not SCHEMAS.is_valid("openai_responses_request", body)


def test_calls_without_a_message_before_them_are_one_assistant_message():
    chat, _ = chat_request({"model": MODEL, "input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"}]})
    assert chat["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_the_prompt_is_the_chat_templates():
    req = parse(instructions="Sys.", tools=[TOOL], chat_template_kwargs={"enable_thinking": False})
    expected = render_chat_template(QWEN3_LIKE_TEMPLATE, [{"role": "system", "content": "Sys."},
                                                          {"role": "user", "content": "hi"}],
                                    tools=[{"type": "function", "function": {"name": "get_weather",
                                                                             "parameters": WEATHER, "strict": True}}],
                                    enable_thinking=False)
    assert req.render_prompt(QWEN) == expected
    assert req.params.grammar is not None  # strict by default: auto calls follow the schema


def test_strict_false_leaves_auto_calls_free():
    assert parse(tools=[{**TOOL, "strict": False}]).params.grammar is None


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [TOOL, TOOL]}, "tools[1].name"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tools": [{**TOOL, "parameters": {"type": "nonsense"}}]}, "tools[0].parameters"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
])
def test_bad_fields_are_400_naming_the_responses_field(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    assert caught.value.param == param, caught.value.message
    assert caught.value.status == 400 or caught.value.status == 422  # 422 is sent as 400 (openai.py)
    assert "function." not in caught.value.message and "messages[" not in caught.value.message


def test_function_tools_on_a_model_without_a_tool_format_take_the_generic_format():
    req = parse(PLAIN, tools=[TOOL], instructions="Be brief.")
    assert req.chat.chat.generic and json.loads(req.params.grammar.value)["syntax"] == "generic"
    prompt = req.render_prompt(PLAIN)
    assert prompt.count("Be brief.") == 1 and '{"name":"get_weather"' in prompt
    text = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}}]}'
    body, events = body_and_stream(req, result(text, pieces=[text[:30], text[30:]]))
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in body["output"]] == [
        ("function_call", "get_weather", '{"city":"Oslo"}')]
    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])
    answer = body_and_stream(req, result('{"response":"It is \\"sunny\\"."}'))[0]
    assert [(i["type"], i["content"][0]["text"]) for i in answer["output"]] == [("message", 'It is "sunny".')]
    with pytest.raises(InvalidRequest) as caught:
        parse_responses_request({"model": MODEL, "input": "hi", "tools": [TOOL]}, SCHEMAS, MODEL, backend=PLAIN,
                                formats=("none", "auto"))
    assert caught.value.param == "tools"


# --- response: body and stream ---------------------------------------------------------------------------

def body_and_stream(req, res: GenerationResult) -> tuple[dict, list[dict]]:
    body = RESPONSES.render_result(req, [res], Context(QWEN))
    SCHEMAS.validate("openai_responses_response", body, root="response")
    stream = ResponsesStream(req, MODEL)
    frames = [f for i, t in enumerate(res.tokens) for f in stream.on_token(TokenEvent(t, i, t.text))]
    frames += stream.on_result(res)
    events = []
    for frame in frames:
        head, data = frame.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        SCHEMAS.validate("openai_responses_event", event, root="event")
        events.append(event)
    return body, events


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


TEXT = '<think>a plan</think>\n\nSure: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
       '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'


@pytest.mark.parametrize("split", range(1, len(TEXT)))
def test_body_and_stream_agree_whatever_the_tokens(split):
    req = parse(tools=[{**TOOL, "strict": False}])
    body, events = body_and_stream(req, result(TEXT, pieces=[TEXT[:split], TEXT[split:]]))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert without_ids(final["output"]) == without_ids(body["output"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(i["type"], i.get("name")) for i in body["output"]] == [
        ("reasoning", None), ("message", None), ("function_call", "get_weather"), ("function_call", "get_weather")]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "a plan"}]
    assert body["output"][1]["content"][0]["text"] == "Sure:"
    assert [json.loads(i["arguments"]) for i in body["output"][2:]] == [{"city": "Oslo"}, {"city": "Lima"}]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == "".join(i["arguments"] for i in body["output"][2:])


def test_the_length_cap_makes_the_response_incomplete():
    body, events = body_and_stream(parse(), result("cut sho", FinishReason.LENGTH))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][-1]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])


def test_a_model_without_reasoning_keeps_its_text_as_generated():
    body, events = body_and_stream(parse(PLAIN), result("  <think>x</think> y "))
    assert [i["type"] for i in body["output"]] == ["message"]
    assert body["output"][0]["content"][0]["text"] == "  <think>x</think> y "
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


def test_an_empty_answer_is_an_empty_message():
    body, _ = body_and_stream(parse(), result(""))
    assert [(i["type"], i["content"][0]["text"]) for i in body["output"]] == [("message", "")]


def test_store_is_accepted_and_reported_false():
    body, _ = body_and_stream(parse(store=True, metadata={"k": "v"}), result("ok"))
    assert body["store"] is False and body["metadata"] == {"k": "v"}


def test_a_failure_after_the_stream_opened_is_an_error_then_response_failed():
    from service.errors import ServiceUnavailable

    stream = ResponsesStream(parse(), MODEL)
    frames = stream.on_token(TokenEvent(Token(0, "Hi", -0.1, False), 0, "Hi"))
    frames += stream.on_error(ServiceUnavailable("the server is shutting down"))
    events = [json.loads(f.removesuffix("\n\n").split("\n")[1].removeprefix("data: ")) for f in frames]
    for event in events:
        SCHEMAS.validate("openai_responses_event", event, root="event")
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "the server is shutting down"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "the server is shutting down"


@pytest.mark.parametrize("error, param, words", [
    ("InputRejected", "input", "too many tokens"),
    ("grammar", "text.format", "text.format does not compile"),
    ("tools", "tools", "tools does not compile"),
])
def test_submit_errors_name_the_responses_fields(error, param, words):
    from backends.errors import InputRejected, ParameterRejected

    fields = {"text": {"format": {"type": "json_object"}}} if error == "grammar" else \
        {"tools": [TOOL], "tool_choice": "required"} if error == "tools" else {}
    req = parse(**fields)
    backend_error = InputRejected("too many tokens") if error == "InputRejected" else \
        ParameterRejected("grammar", "bad grammar")
    refused = RESPONSES.submit_error(backend_error, req)
    assert refused.param == param and words in refused.message
