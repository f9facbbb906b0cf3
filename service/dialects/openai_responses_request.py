"""The Responses dialect's request side: a ``/v1/responses`` body → schema check
(``openai_responses_request.schema.json``) → the ``/v1/chat/completions`` body it means → the chat dialect's
``OpenAIRequest`` (``openai_request.py``), so the messages, tools, grammar and reasoning are handled once.

Stateless, as llama-server serves it: ``instructions`` is a system message before the input; input items
become messages (consecutive ``function_call`` items one assistant message with ``tool_calls``, a
``function_call_output`` a ``tool`` message, ``reasoning`` items dropped); flat function tools become chat
tools (``strict`` defaulting to true, as OpenAI's); ``text.format`` becomes ``response_format``. An error
the chat side finds names the Responses field (``input[3]``, ``tools[0].parameters``, ``text.format``).
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import Backend
from service.dialects.openai_request import (ChatTranslation, InvalidRequest, OpenAIRequest, check_body,
                                             parse_openai_request)
from service.errors import ServiceError
from service.validation import Schemas, show

SCHEMA = "openai_responses_request"
# fields copied as they are into the chat body
_SAME = ("model", "temperature", "top_p", "top_k", "seed", "logit_bias", "stream", "user", "parallel_tool_calls",
         "chat_template_kwargs", "thinking_budget")


@dataclass(frozen=True, slots=True)
class ResponsesRequest(ChatTranslation):
    """A Responses request: the chat request it runs as, and the fields its response echoes."""

    chat: OpenAIRequest
    body: dict[str, Any]  # the Responses body as sent (schema-valid)
    response_id: str
    origins: tuple[str, ...] = ()  # the Responses field each chat message came from (for error messages)


def parse_responses_request(body: Any, schemas: Schemas, model_name: str, adapters: Collection[str] = (),
                            media_types: Collection[str] = (), backend: Backend | None = None,
                            formats: tuple[str, str] = ("auto", "auto")) -> ResponsesRequest:
    """Validate ``body``, translate it and parse it as a chat request; errors name the Responses fields."""
    check_body(schemas, SCHEMA, body)
    if body.get("previous_response_id") is not None:
        raise InvalidRequest(f"previous_response_id {show(body['previous_response_id'])}: this server stores no "
                             "responses; send the whole conversation in input instead", "previous_response_id")
    chat_body, origins = chat_request(body)
    try:
        chat = parse_openai_request("chat", chat_body, schemas, model_name, adapters, media_types, backend, formats)
    except ServiceError as exc:
        raise renamed(exc, origins) from None
    return ResponsesRequest(chat, body, "resp_" + uuid.uuid4().hex, tuple(origins))


def chat_request(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the chat body, the Responses field each of its messages came from)."""
    messages, origins = [], []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": body["instructions"]})
        origins.append("instructions")
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for i, item in enumerate(items):
        _add_item(item, f"input[{i}]", messages, origins)
    if not messages:
        raise InvalidRequest("input has no message, function_call or function_call_output item", "input")
    chat = {key: body[key] for key in _SAME if body.get(key) is not None}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool) for tool in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice["name"]}}
    text_format = (body.get("text") or {}).get("format")
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    return chat, origins


def _add_item(item: dict[str, Any], field: str, messages: list[dict[str, Any]], origins: list[str]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        content = item["content"]
        if not isinstance(content, str):
            content = [_part(p) for p in content]
        messages.append({"role": item["role"], "content": content})
        origins.append(field)
    elif kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the calls of the answer just before
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            origins.append(field)
    elif kind == "function_call_output":
        output = item["output"]
        text = output if isinstance(output, str) else "".join(p["text"] for p in output)
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        origins.append(field)
    # reasoning items: the model's earlier thoughts; chat templates drop them from past turns


def _part(part: dict[str, Any]) -> dict[str, Any]:
    if part["type"] == "input_image":
        return {"type": "image_url", "image_url": {"url": part["image_url"],
                                                   **({"detail": part["detail"]} if "detail" in part else {})}}
    return {"type": "text", "text": part["text"]}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """The chat tool (keys in the chat API's order: a template writes the tool as it is)."""
    function = {"name": tool["name"]}
    for key in ("description", "parameters"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": {**function, "strict": tool.get("strict") is not False}}


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    schema = {key: text_format[key] for key in ("name", "description", "schema", "strict") if key in text_format}
    return {"type": "json_schema", "json_schema": schema}


# --- the chat side's field names → the Responses ones --------------------------------------------------

_FIELDS = (
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"\bresponse_format\.json_schema\."), "text.format."),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
)
_MESSAGE = re.compile(r"(?<![.\w\"])messages(\[(\d+)\])?")  # not chat_template_kwargs.messages, "messages"


def rename(text: str, origins: Sequence[str]) -> str:
    """``text`` (a field name or an error message) with the chat request's field names as the Responses
    request names them."""
    for pattern, replacement in _FIELDS:
        text = pattern.sub(replacement, text)

    def message(found: re.Match) -> str:
        index = found.group(2)
        if index is None:
            return "input"
        at = int(index)
        return origins[at] if at < len(origins) else "input"
    return _MESSAGE.sub(message, text)


def renamed(error: ServiceError, origins: Sequence[str]) -> ServiceError:
    """The chat side's error with the Responses field names (message and ``param``)."""
    if isinstance(error, InvalidRequest):
        param = None if error.param is None else rename(error.param, origins)
        return InvalidRequest(rename(error.message, origins), param)
    return error
