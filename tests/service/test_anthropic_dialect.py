"""The Anthropic Messages dialect without a model: a /v1/messages body → the chat request it means (written by
hand here), errors naming the Messages fields, a generated text → the body and the stream (checked against
the schemas and against each other at every split of the text), stop reasons, the error shape and the key."""
from __future__ import annotations

import json
from typing import Any

import pytest

from backends.types import FinishReason, GenerationResult, Token, TokenEvent
from service.dialects.anthropic import MESSAGES, MessagesStream, anthropic_error, key_refusal
from service.dialects.anthropic_output import matched_stop, stop_reason
from service.dialects.anthropic_request import chat_request, parse_messages_request
from service.dialects.openai_request import InvalidRequest
from service.errors import (IncompleteGeneration, NotFound, PayloadTooLarge, ServiceUnavailable, TooManyRequests,
                            Unauthorized, ValidationError)
from service.validation import default_schemas
from tests.support.tiny_chat_model import QWEN3_LIKE_TEMPLATE, TemplateBackend
from tests.support.tiny_checkpoint import CHAT_TEMPLATE

SCHEMAS = default_schemas()
MODEL = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER}
QWEN = TemplateBackend(QWEN3_LIKE_TEMPLATE, MODEL)
PLAIN = TemplateBackend(CHAT_TEMPLATE, MODEL)
HI = [{"role": "user", "content": "hi"}]
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 9, "messages": HI, **fields}


def parse(backend: TemplateBackend = QWEN, media: tuple[str, ...] = (), **fields: Any):
    return parse_messages_request(body(**fields), SCHEMAS, MODEL, media_types=media, backend=backend)


def result(text: str, finish: FinishReason = FinishReason.EOS_TOKEN, pieces: list[str] | None = None):
    pieces = pieces if pieces is not None else list(text)
    tokens = tuple(Token(i, p, -0.5, False) for i, p in enumerate(pieces))
    return GenerationResult(text, finish, 5, len(tokens), 1, tokens, cached_tokens=2)


# --- request: the chat body it means ---------------------------------------------------------------------

def test_a_tool_conversation_becomes_chat_messages():
    sent = body(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Really."}],
                stop_sequences=["END"], temperature=0, top_k=5, tools=[TOOL],
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                thinking={"type": "enabled", "budget_tokens": 7}, metadata={"user_id": "u"},
                messages=[{"role": "user", "content": [{"type": "text", "text": "weather"},
                                                       {"type": "text", "text": "in Paris?",
                                                        "cache_control": {"type": "ephemeral"}}]},
                          {"role": "assistant", "content": [
                              {"type": "thinking", "thinking": "hm", "signature": "s"},
                              {"type": "text", "text": "Let me see."},
                              {"type": "tool_use", "id": "toolu_a", "name": "get_weather",
                               "input": {"city": "Paris"}}]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a",
                                                        "content": [{"type": "text", "text": "sun"}]}]},
                          {"role": "user", "content": "Thanks"}])
    chat, origins, prefill = chat_request(sent, frozenset())
    assert chat == {
        "model": MODEL, "temperature": 0, "top_k": 5, "max_completion_tokens": 9, "stop": ["END"],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                    "parameters": WEATHER}}],
        "tool_choice": "required", "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": True}, "thinking_budget": 7,
        "messages": [
            {"role": "system", "content": "Be brief.\nReally."},
            {"role": "user", "content": [{"type": "text", "text": "weather\nin Paris?"}]},
            {"role": "assistant", "content": "Let me see.", "tool_calls": [
                {"id": "toolu_a", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_a", "content": [{"type": "text", "text": "sun"}]},
            {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}]}
    assert prefill == ""
    assert [where for where, _ in origins] == ["system", "messages[0]", "messages[1]", "messages[2].content[0]",
                                               "messages[3]"]


@pytest.mark.parametrize("choice, chat", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                          ({"type": "none"}, "none"),
                                          ({"type": "tool", "name": "get_weather"},
                                           {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choices(choice, chat):
    assert chat_request(body(tools=[TOOL], tool_choice=choice), frozenset())[0]["tool_choice"] == chat


@pytest.mark.parametrize("thinking, kwargs, budget", [({"type": "disabled"}, {"enable_thinking": False}, None),
                                                      ({"type": "adaptive"}, None, None),
                                                      ({"type": "enabled", "budget_tokens": 3},
                                                       {"enable_thinking": True}, 3)])
def test_thinking(thinking, kwargs, budget):
    chat = chat_request(body(thinking=thinking), frozenset())[0]
    assert chat.get("chat_template_kwargs") == kwargs and chat.get("thinking_budget") == budget


def test_a_last_assistant_turn_is_a_prefill_at_the_end_of_the_prompt():
    req = parse(PLAIN, messages=HI + [{"role": "assistant", "content": "The"},
                                      {"role": "assistant", "content": [{"type": "text", "text": "answer"}]}])
    assert req.prefill == "The\nanswer"
    rendered = PLAIN.apply_chat_template([{"role": "user", "content": "hi"}])
    assert req.render_prompt(_Counting(PLAIN)) == rendered + "The\nanswer"
    assert req.counted.tokens == len(rendered + "The\nanswer")


class _Counting:
    """A template backend whose tokenizer is one token per character."""

    def __init__(self, backend: TemplateBackend) -> None:
        self.model_name, self.chat_template = backend.model_name, backend.chat_template
        self.apply_chat_template = backend.apply_chat_template

    @staticmethod
    def tokenize(text: str) -> list[int]:
        return [ord(c) for c in text]


def test_images_become_image_parts_where_the_model_takes_them():
    url = {"type": "url", "url": "https://example.com/cat.png"}
    req = parse(PLAIN, ("image_url",), messages=[{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image", "source": PNG}, {"type": "image", "source": url}]}])
    assert [ref.field for ref in req.media] == ["messages[0].content[1]", "messages[0].content[2]"]
    assert req.chat.messages[0]["content"].count("\ue000") == 2


@pytest.mark.parametrize("fields, says, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": PNG}]}]},
     "messages[0].content[0] is an image block, which this model does not accept", "messages[0].content[0].type"),
    ({"tools": [{**TOOL, "input_schema": {"type": "objectx"}}]}, "tools[0].input_schema does not compile",
     "tools[0].input_schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "f"}}, 'the function "f", which is not in tools',
     "tool_choice.name"),
    ({"tools": [TOOL, TOOL]}, 'tools[1].name "get_weather" is the name of another tool too', "tools[1].name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice is not allowed: any and tool need tools", "tool_choice"),
    ({"stop_sequences": ["x" * 1000] * 33}, "stop_sequences must total at most 32768", "stop_sequences"),
    ({"tools": [TOOL], "tool_choice": {"type": "any"}, "output_config": {"format": {"type": "json_schema",
                                                                                    "schema": WEATHER}}},
     "output_config is not allowed: a format cannot be combined with calls the server enforces (tool_choice any",
     "output_config"),
    ({"messages": HI + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                          "input": {}}]}]},
     "messages[1].content[0] is a tool_use in the last message", "messages[1].content[0]"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, 'messages[0].role must be "user"', "messages[0].role"),
    ({"temperature": 5e-7}, "temperature must not be", "temperature"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]},
     "tools[0].type must be one of", "tools[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{"a": 1}]}]}]},
     "messages[0].content[0].citations must have at most 0 items", "messages[0].content[0].citations"),
])
def test_errors_name_the_messages_fields(fields, says, param):
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    assert says in caught.value.message and caught.value.param == param, (caught.value.message, caught.value.param)


def test_tools_on_a_template_without_a_tool_format_take_the_generic_format():
    req = parse(PLAIN, tools=[TOOL], tool_choice={"type": "any"})
    assert req.chat.chat.generic and json.loads(req.chat.params.grammar.value)["syntax"] == "generic"
    assert not parse(PLAIN, tools=[TOOL], tool_choice={"type": "none"}).chat.chat.calls_allowed


def test_count_tokens_refuses_image_blocks():
    sent = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image", "source": PNG}]}]}
    with pytest.raises(InvalidRequest, match="count_tokens does not count image blocks"):
        parse_messages_request(sent, SCHEMAS, MODEL, media_types=("image_url",), backend=PLAIN, count=True)


# --- response: the body and the stream -------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
OUTPUTS = [("<think>let me think</think>\n\nIt is sunny.", ["thinking", "text"]),
           ("Checking. " + CALL, ["text", "tool_use"]),
           ("<think>hm</think>" + CALL + CALL, ["thinking", "tool_use", "tool_use"]),
           ("Plain answer.", ["text"])]


def stream(req, pieces: list[str], res: GenerationResult) -> list[dict]:
    codec = MessagesStream(req, MODEL)
    frames = []
    for i, piece in enumerate(pieces):
        frames += codec.on_token(TokenEvent(Token(i, piece, -0.5, False), i, piece))
    frames += codec.on_result(res)
    events = []
    for frame in frames:
        head, data = frame.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        SCHEMAS.validate("anthropic_messages_event", event, root="event")
        events.append(event)
    return events


def accumulate(events: list[dict]) -> dict:
    """The message the events build, as the anthropic client's accumulator does (partial_json joined)."""
    message, partial = events[0]["message"], {}
    for event in events[1:]:
        if event["type"] == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] += delta[key]
        elif event["type"] == "content_block_stop" and event["index"] in partial:
            message["content"][event["index"]]["input"] = json.loads(partial[event["index"]])
        elif event["type"] == "message_delta":
            message.update(event["delta"])
            message["usage"].update(event["usage"])
    return message


class Context:
    backend = QWEN


@pytest.mark.parametrize("text, kinds", OUTPUTS)
def test_the_stream_builds_the_body_at_every_split(text, kinds):
    req = parse(tools=[TOOL])
    res = result(text)
    rendered = MESSAGES.render_result(req, [res], Context())
    SCHEMAS.validate("anthropic_messages_response", rendered, root="message")
    assert [block["type"] for block in rendered["content"]] == kinds
    assert rendered["stop_reason"] == ("tool_use" if "tool_use" in kinds else "end_turn")
    assert rendered["usage"] == {"input_tokens": 5, "output_tokens": len(text), "cache_read_input_tokens": 2}
    for block in rendered["content"]:
        if block["type"] == "tool_use":
            assert block["input"] == {"city": "Oslo"} and block["id"].startswith("toolu_")
    for at in range(len(text) + 1):
        events = stream(req, [text[:at], text[at:]], res)
        types = [e["type"] for e in events]
        assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
        built = accumulate(events)
        assert [{k: v for k, v in b.items() if k != "id"} for b in built["content"]] == \
            [{k: v for k, v in b.items() if k != "id"} for b in rendered["content"]], at
        assert {k: built[k] for k in ("stop_reason", "stop_sequence", "usage")} == \
            {k: rendered[k] for k in ("stop_reason", "stop_sequence", "usage")}


@pytest.mark.parametrize("text, pieces, finish, stop, expected", [
    ("Hello ", ["Hello", " wor", "ld"], FinishReason.STOP_SEQUENCE, ("world", "wor"), ("stop_sequence", "wor")),
    ("Hello ", ["Hello", " world"], FinishReason.STOP_SEQUENCE, ("xyz", "world"), ("stop_sequence", "world")),
    ("Hello", ["Hello", "<eos>"], FinishReason.EOS_TOKEN, ("world",), ("end_turn", None)),
    ("Hello", ["Hello"], FinishReason.LENGTH, ("world",), ("max_tokens", None)),
    ("Hello", ["Hello"], FinishReason.STOP_SEQUENCE, (), ("end_turn", None)),  # stopped from outside
])
def test_stop_reasons(text, pieces, finish, stop, expected):
    assert stop_reason(result(text, finish, pieces), False, stop) == expected
    assert stop_reason(result(text, finish, pieces), True, stop)[0] == (
        "max_tokens" if finish == FinishReason.LENGTH else "tool_use")


def test_matched_stop_is_none_when_the_tokens_do_not_continue_the_text():
    assert matched_stop(result("Hi", FinishReason.STOP_SEQUENCE, ["Ha", "X"]), ("X",)) is None


def test_a_failure_after_the_stream_opened_is_an_error_event():
    codec = MessagesStream(parse(), MODEL)
    frames = codec.on_token(TokenEvent(Token(0, "a", -0.5, False), 0, "a")) + \
        codec.on_error(IncompleteGeneration("timed out"))
    assert frames[-1] == 'event: error\ndata: {"type":"error","error":{"type":"api_error",' \
                         '"message":"timed out"}}\n\n'


# --- errors and the key ----------------------------------------------------------------------------------

@pytest.mark.parametrize("error, status, kind", [
    (ValidationError("x"), 400, "invalid_request_error"), (InvalidRequest("x"), 400, "invalid_request_error"),
    (Unauthorized("x"), 401, "authentication_error"), (NotFound("x"), 404, "not_found_error"),
    (PayloadTooLarge("x"), 413, "request_too_large"), (TooManyRequests("x"), 529, "overloaded_error"),
    (ServiceUnavailable("x"), 503, "overloaded_error"), (IncompleteGeneration("x"), 500, "api_error"),
    (RuntimeError("secret"), 500, "api_error"),
])
def test_error_shape(error, status, kind):
    sent, payload = anthropic_error(error)
    assert sent == status and payload["type"] == "error" and payload["error"]["type"] == kind
    assert "secret" not in payload["error"]["message"]
    SCHEMAS.validate("anthropic_error", payload)


@pytest.mark.parametrize("api_key, headers, bearer_ok, passes", [
    (None, {}, True, True),
    ("k", {"x-api-key": "k"}, False, True),
    ("k", {"x-api-key": " k "}, False, True),
    ("k", {"x-api-key": "nope"}, True, False),  # a wrong x-api-key is refused even beside a good bearer
    ("k", {}, True, True),
    ("k", {}, False, False),
])
def test_x_api_key(api_key, headers, bearer_ok, passes):
    bearer = None if bearer_ok else Unauthorized("no bearer")
    assert (key_refusal(api_key, headers, bearer) is None) == passes


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "none"}])
def test_auto_or_none_without_tools_is_a_plain_answer(choice):
    chat = chat_request(body(tool_choice=choice), frozenset())[0]
    assert "tool_choice" not in chat and "tools" not in chat
