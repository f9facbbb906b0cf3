"""The Anthropic Messages dialect's output: a chat's generated text, parsed by ``backends/chat_output.py``, as
content blocks (``thinking``, ``text``, ``tool_use``) and as the stream events that build them
(``content_block_start``, ``content_block_delta`` with ``thinking_delta`` / ``text_delta`` /
``input_json_delta``, ``content_block_stop``); and the message's ``stop_reason``. A body is the same builder fed
the whole text, so a stream's blocks equal the body's however the text was split into tokens.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from backends.chat_output import CallArguments, CallStart, Content, Event, Reasoning
from backends.types import FinishReason, GenerationResult
from service.dialects.openai_tools import ChatOptions

_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
           "tool_use": ("input_json_delta", "partial_json")}


def new_tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


class _Block:
    """One content block being written: its opening (empty) shape, its deltas and its final shape."""

    def __init__(self, kind: str, index: int, name: str = "") -> None:
        self.kind, self.index, self.name, self.text = kind, index, name, ""
        self.id = new_tool_use_id() if kind == "tool_use" else ""

    def block(self, text: str) -> dict[str, Any]:
        if self.kind == "tool_use":
            return {"type": "tool_use", "id": self.id, "name": self.name, "input": tool_input(text) if text else {}}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": ""}
        return {"type": "text", "text": text}

    def start(self) -> dict[str, Any]:
        return {"type": "content_block_start", "index": self.index, "content_block": self.block("")}

    def delta(self, text: str) -> dict[str, Any]:
        self.text += text
        kind, key = _DELTAS[self.kind]
        return {"type": "content_block_delta", "index": self.index, "delta": {"type": kind, key: text}}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's ``input``: its arguments object; ``{}`` when the length cap cut the arguments short (the stream
    sent what there was as ``input_json_delta``)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageContent:
    """The content of one message: ``feed`` the generated text as it comes, then ``finish``; each returns the
    stream events it makes; ``blocks`` is the content."""

    def __init__(self, options: ChatOptions) -> None:
        self._parser = options.output_parser() if options.parses else None
        self.blocks: list[dict[str, Any]] = []
        self._open: _Block | None = None
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self._parser.feed(text) if self._parser is not None else [Content(text)]
        return [e for event in events for e in self._on(event)]

    def finish(self) -> list[dict[str, Any]]:
        out = [e for event in (self._parser.finish() if self._parser is not None else ()) for e in self._on(event)]
        return out + self._close()

    def _on(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, CallStart):
            self.called = True
            return self._start("tool_use", event.name)
        if not event.text:
            return []
        kind = {Reasoning: "thinking", Content: "text", CallArguments: "tool_use"}[type(event)]
        out = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        return out + [self._open.delta(event.text)]

    def _start(self, kind: str, name: str = "") -> list[dict[str, Any]]:
        out = self._close()
        self._open = _Block(kind, len(self.blocks), name)
        return out + [self._open.start()]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self.blocks.append(self._open.block(self._open.text))
        index, self._open = self._open.index, None
        return [{"type": "content_block_stop", "index": index}]


def stop_reason(result: GenerationResult, called: bool, stop: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): max_tokens at the length cap, tool_use for an answer that called tools,
    stop_sequence with the one of ``stop`` that matched, else end_turn."""
    finish = FinishReason(result.finish_reason)
    if finish == FinishReason.LENGTH:
        return "max_tokens", None
    if called:
        return "tool_use", None
    matched = matched_stop(result, stop) if finish == FinishReason.STOP_SEQUENCE else None
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def matched_stop(result: GenerationResult, stop: tuple[str, ...]) -> str | None:
    """The stop sequence the output was cut before: the generated tokens' text goes on past the output with
    it (the shortest, if several start there: it completed first)."""
    text = "".join(t.text for t in result.tokens if not t.special)
    if not text.startswith(result.generated_text):
        return None
    rest = text[len(result.generated_text):]
    found = [s for s in stop if rest.startswith(s)]
    return min(found, key=len) if found else None
