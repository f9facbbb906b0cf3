"""The Anthropic Messages dialect's request side: a ``/v1/messages`` (or ``/v1/messages/count_tokens``) body →
schema check (``anthropic_*_request.schema.json``) → the ``/v1/chat/completions`` body it means → the chat
dialect's ``OpenAIRequest`` (``openai_request.py``), so the model check, template, tools, grammar, reasoning
and media are handled once.

The translation: ``system`` is a system message; consecutive turns of one role are one turn; a user turn's
``tool_result`` blocks are ``tool`` messages and its text and image blocks a user message, in their order;
an assistant turn's ``tool_use`` blocks are its ``tool_calls``, its thinking blocks are dropped; a last
assistant turn (text only) is a prefill the answer continues. Text blocks side by side are joined with a
newline. An error the chat side finds names the Messages field (``messages[2].content[1]``,
``tools[0].input_schema``).
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from backends.base import Backend
from service.dialects.openai_request import (ChatTranslation, InvalidRequest, OpenAIRequest, check_body,
                                             parse_openai_request)
from service.errors import ServiceError
from service.validation import Schemas, show

SCHEMA = "anthropic_messages_request"
COUNT_SCHEMA = "anthropic_count_tokens_request"
IMAGE_PART = "image_url"  # the chat part type an image block becomes (and the part type the model must accept)
_SAME = ("model", "temperature", "top_p", "top_k", "stream")  # fields copied as they are into the chat body
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(slots=True)
class PromptCount:
    """The rendered prompt's tokens, counted when it renders (a stream's ``message_start`` states them)."""

    tokens: int | None = None


@dataclass(frozen=True, slots=True)
class MessagesRequest(ChatTranslation):
    """A Messages request: the chat request it runs as, and what its response needs."""

    chat: OpenAIRequest
    message_id: str
    stop: tuple[str, ...] = ()  # stop_sequences
    prefill: str = ""  # the text of a last assistant turn: the prompt ends with it, the answer continues it
    origins: tuple[tuple[str, tuple[str, ...]], ...] = ()  # per chat message: its Messages field, its parts'
    counted: PromptCount = field(default_factory=PromptCount, compare=False)

    def render_prompt(self, backend: Backend) -> str:
        """The chat prompt, then the prefill; a prompt without media is counted here too (as ``submit`` will)."""
        prompt = self.chat.render_prompt(backend) + self.prefill
        if not self.media:
            self.counted.tokens = len(backend.tokenize(prompt))
        return prompt


def parse_messages_request(body: Any, schemas: Schemas, model_name: str, adapters: Collection[str] = (),
                           media_types: Collection[str] = (), backend: Backend | None = None,
                           formats: tuple[str, str] = ("auto", "auto"), *, count: bool = False) -> MessagesRequest:
    """Validate ``body`` (a count_tokens body if ``count``), translate it and parse it as a chat request;
    errors are ``InvalidRequest`` (400) or ``ModelNotFound`` (404), naming the Messages fields."""
    check_body(schemas, COUNT_SCHEMA if count else SCHEMA, body)
    chat_body, origins, prefill = chat_request(body, frozenset(media_types), count=count)
    try:
        chat = parse_openai_request("chat", chat_body, schemas, model_name, adapters, media_types, backend, formats)
    except ServiceError as exc:
        raise renamed(exc, origins) from None
    media = tuple(replace(ref, field=rename(ref.field, origins)) for ref in chat.media)
    return MessagesRequest(replace(chat, media=media), "msg_" + uuid.uuid4().hex[:24],
                           tuple(body.get("stop_sequences") or ()), prefill, tuple(origins))


# --- the translation -----------------------------------------------------------------------------------

Origins = list[tuple[str, tuple[str, ...]]]


def chat_request(body: dict[str, Any], media_types: frozenset[str], *, count: bool = False
                 ) -> tuple[dict[str, Any], Origins, str]:
    """(the chat body, each chat message's Messages field and its parts', the prefill text)."""
    messages: list[dict[str, Any]] = []
    origins: Origins = []
    if body.get("system"):
        messages.append({"role": "system", "content": _joined(body["system"])})
        origins.append(("system", ()))
    turns = _turns(body["messages"])
    prefill = _prefill(turns.pop()) if turns[-1][0] == "assistant" else ""
    for role, blocks in turns:
        add = _user_messages if role == "user" else _assistant_message
        add(blocks, messages, origins, media_types, count)
    chat = {key: body[key] for key in _SAME if body.get(key) is not None}
    chat["messages"] = messages
    if not count:
        chat["max_completion_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    _add_tools(body, chat)
    _add_thinking(body.get("thinking"), chat)
    schema = ((body.get("output_config") or {}).get("format") or {}).get("schema")
    if schema is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    return chat, origins, prefill


Block = tuple[str, dict[str, Any]]  # (its Messages field, the block)


def _turns(messages: list[dict[str, Any]]) -> list[tuple[str, list[Block]]]:
    """The conversation as turns, consecutive messages of one role joined; each block with its field."""
    turns: list[tuple[str, list[Block]]] = []
    for i, message in enumerate(messages):
        content = message["content"]
        blocks = [(f"messages[{i}].content", {"type": "text", "text": content})] if isinstance(content, str) else \
            [(f"messages[{i}].content[{j}]", block) for j, block in enumerate(content)]
        if turns and turns[-1][0] == message["role"]:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message["role"], blocks))
    return turns


def _prefill(turn: tuple[str, list[Block]]) -> str:
    """The text a last assistant turn puts at the start of the answer."""
    for where, block in turn[1]:
        if block["type"] == "tool_use":
            raise InvalidRequest(f"{where} is a tool_use in the last message: send its tool_result in a user "
                                 "message after it", where)
    return "\n".join(block["text"] for _, block in turn[1] if block["type"] == "text")


def _user_messages(blocks: list[Block], messages: list[dict[str, Any]], origins: Origins,
                   media_types: frozenset[str], count: bool) -> None:
    """A user turn: each tool_result a tool message, the text and image blocks between them a user message."""
    parts: list[dict[str, Any]] = []
    fields: list[str] = []

    def flush() -> None:
        if parts:
            messages.append({"role": "user", "content": list(parts)})
            origins.append((_common(fields), tuple(fields)))
            parts.clear()
            fields.clear()

    for where, block in blocks:
        if block["type"] == "tool_result":
            flush()
            content = block.get("content", "")
            result = [(f"{where}.content[{j}]", b) for j, b in enumerate(content)] if isinstance(content, list) \
                else [(f"{where}.content", {"type": "text", "text": content})]
            tool_parts, tool_fields = _parts(result, media_types, count)
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                             "content": tool_parts or ""})
            origins.append((where, tuple(tool_fields)))
        else:
            more, more_fields = _parts([(where, block)], media_types, count)
            _extend(parts, fields, more, more_fields)
    flush()


def _parts(blocks: list[Block], media_types: frozenset[str], count: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Text and image blocks as chat content parts (text blocks side by side joined with a newline)."""
    parts: list[dict[str, Any]] = []
    fields: list[str] = []
    for where, block in blocks:
        if block["type"] == "text":
            _extend(parts, fields, [{"type": "text", "text": block["text"]}], [where])
            continue
        if IMAGE_PART not in media_types:
            raise InvalidRequest(f"{where} is an image block, which this model does not accept (it takes text "
                                 "only)", f"{where}.type")
        if count:
            raise InvalidRequest(f"{where}: count_tokens does not count image blocks (their tokens are known once "
                                 "the image is loaded); /v1/messages reports them in usage.input_tokens", where)
        source = block["source"]
        url = source["url"] if source["type"] == "url" else f"data:{source['media_type']};base64,{source['data']}"
        parts.append({"type": IMAGE_PART, "image_url": {"url": url}})
        fields.append(where)
    return parts, fields


def _extend(parts: list[dict[str, Any]], fields: list[str], more: list[dict[str, Any]], more_fields: list[str]
            ) -> None:
    """Append parts; a text part after a text part joins it with a newline."""
    for part, where in zip(more, more_fields):
        if part["type"] == "text" and parts and parts[-1]["type"] == "text":
            parts[-1] = {"type": "text", "text": parts[-1]["text"] + "\n" + part["text"]}
        else:
            parts.append(part)
            fields.append(where)


def _assistant_message(blocks: list[Block], messages: list[dict[str, Any]], origins: Origins,
                       media_types: frozenset[str], count: bool) -> None:
    """An assistant turn: its text, and its tool_use blocks as tool calls (thinking blocks dropped)."""
    text = [block["text"] for _, block in blocks if block["type"] == "text"]
    calls = [{"id": block["id"], "type": "function",
              "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}
             for _, block in blocks if block["type"] == "tool_use"]
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    messages.append(message)
    origins.append((_common([where for where, _ in blocks]), ()))


def _common(fields: Sequence[str]) -> str:
    """The message field the blocks' fields share (``messages[3]``), or the first's for a joined turn."""
    first = fields[0] if fields else "messages"
    found = re.match(r"messages\[\d+\]", first)
    return found.group(0) if found else first


def _add_tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools") or []
    if tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": tool["name"], **({"description": tool["description"]} if tool.get("description") else {}),
            "parameters": tool["input_schema"], **({"strict": tool["strict"]} if tool.get("strict") else {})}}
            for tool in tools]
    choice = body.get("tool_choice")
    if choice is None:
        return
    if choice["type"] in ("any", "tool") and not tools:
        raise InvalidRequest(f"tool_choice {show(choice['type'])} needs tools; the request has none", "tool_choice")
    if not tools:  # auto or none with no tools: the model answers in text, as without tool_choice
        return
    chat["tool_choice"] = _CHOICES.get(choice["type"]) or {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _add_thinking(thinking: dict[str, Any] | None, chat: dict[str, Any]) -> None:
    """enabled: the template's enable_thinking true and the budget; disabled: enable_thinking false."""
    if thinking is None or thinking["type"] == "adaptive":
        return
    enabled = thinking["type"] == "enabled"
    chat["chat_template_kwargs"] = {"enable_thinking": enabled}
    if enabled:
        chat["thinking_budget"] = thinking["budget_tokens"]


def _joined(system: str | list[dict[str, Any]]) -> str:
    return system if isinstance(system, str) else "\n".join(block["text"] for block in system)


# --- the chat side's field names → the Messages ones ----------------------------------------------------

_FIELDS = (
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r'\btool_choice "required"'), 'tool_choice "any"'),
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "output_config.format.schema"),
    (re.compile(r"\bresponse_format\b"), "output_config.format"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
    (re.compile(r"\bthinking_budget\b"), "thinking.budget_tokens"),
    (re.compile(r"\bchat_template_kwargs(\.\w+)?"), "thinking"),
    (re.compile(r"(?<![\w.])stop(?![\w])"), "stop_sequences"),
)
_MESSAGE = re.compile(r"(?<![.\w\"])messages(?:\[(\d+)\](?:\.content\[(\d+)\])?)?")


def rename(text: str, origins: Sequence[tuple[str, tuple[str, ...]]]) -> str:
    """``text`` (a field name or an error message) with the chat request's field names as the Messages
    request names them."""
    for pattern, replacement in _FIELDS:
        text = pattern.sub(replacement, text)

    def message(found: re.Match) -> str:
        if found.group(1) is None:
            return "messages"
        at = int(found.group(1))
        if at >= len(origins):
            return "messages"
        where, parts = origins[at]
        if found.group(2) is not None and int(found.group(2)) < len(parts):
            return parts[int(found.group(2))]
        return where
    return _MESSAGE.sub(message, text)


def renamed(error: ServiceError, origins: Sequence[tuple[str, tuple[str, ...]]]) -> ServiceError:
    """The chat side's error with the Messages field names (message and ``param``)."""
    if isinstance(error, InvalidRequest):
        param = None if error.param is None else rename(error.param, origins)
        return InvalidRequest(rename(error.message, origins), param)
    return error

