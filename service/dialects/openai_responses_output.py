"""The Responses dialect's output: a chat's generated text, parsed by ``backends/chat_output.py``, as the
Responses API's output items (``reasoning``, ``message``, ``function_call``) and as the stream events that
build them (``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
… ``response.output_item.done``). A body is the same builder fed the whole text, so a stream's items equal
the body's however the text was split into tokens.
"""
from __future__ import annotations

import uuid
from typing import Any

from backends.chat_output import CallArguments, CallStart, Content, Event, Reasoning, reasoning_tokens
from backends.types import FinishReason, GenerationResult
from service.dialects.openai_chat_output import new_call_id
from service.dialects.openai_tools import ChatOptions

COMPLETED, INCOMPLETE, IN_PROGRESS = "completed", "incomplete", "in_progress"


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class _Item:
    """One output item being written: its final shape, and the events that open, extend and close it."""

    def __init__(self, kind: str, index: int, name: str = "") -> None:
        self.kind, self.index, self.text = kind, index, ""
        prefix = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}[kind]
        self.id = _id(prefix)
        self.call_id, self.name = (new_call_id(), name) if kind == "function_call" else ("", "")

    def item(self, status: str) -> dict[str, Any]:
        """The item in its shape at ``status`` (in progress: without its text)."""
        done = status != IN_PROGRESS
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                    "arguments": self.text if done else "", "status": status}
        parts = [self.part()] if done else []
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": parts, "status": status}
        return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": parts}

    def part(self, text: str | None = None) -> dict[str, Any]:
        text = self.text if text is None else text
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def opening(self) -> list[dict[str, Any]]:
        out = [{"type": "response.output_item.added", "output_index": self.index, "item": self.item(IN_PROGRESS)}]
        if self.kind != "function_call":
            out.append({"type": "response.content_part.added", "item_id": self.id, "output_index": self.index,
                        "content_index": 0, "part": self.part("")})
        return out

    def delta(self, text: str) -> dict[str, Any]:
        self.text += text
        where = {"item_id": self.id, "output_index": self.index}
        if self.kind == "function_call":
            return {"type": "response.function_call_arguments.delta", **where, "delta": text}
        if self.kind == "reasoning":
            return {"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text}
        return {"type": "response.output_text.delta", **where, "content_index": 0, "delta": text, "logprobs": []}

    def closing(self, status: str) -> list[dict[str, Any]]:
        where = {"item_id": self.id, "output_index": self.index}
        if self.kind == "function_call":
            out = [{"type": "response.function_call_arguments.done", **where, "name": self.name,
                    "arguments": self.text}]
        else:
            done = {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": self.text} \
                if self.kind == "reasoning" else \
                {"type": "response.output_text.done", **where, "content_index": 0, "text": self.text, "logprobs": []}
            out = [done, {"type": "response.content_part.done", **where, "content_index": 0, "part": self.part()}]
        return out + [{"type": "response.output_item.done", "output_index": self.index, "item": self.item(status)}]


class ResponseOutput:
    """The output of one response: ``feed`` the generated text as it comes, then ``finish`` with the result;
    each returns the stream events it makes (without ``sequence_number``); ``items`` is the output."""

    def __init__(self, options: ChatOptions) -> None:
        self._options = options
        self._parser = options.output_parser() if options.parses else None
        self.items: list[dict[str, Any]] = []  # the closed items
        self._open: _Item | None = None
        self._count = 0
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self._parser.feed(text) if self._parser is not None else [Content(text)]
        return [e for event in events for e in self._on(event)]

    def finish(self, result: GenerationResult) -> list[dict[str, Any]]:
        """The events of the rest; the last item is incomplete if the length cap cut the output."""
        out = [e for event in (self._parser.finish() if self._parser is not None else ()) for e in self._on(event)]
        if self._open is None and not any(i["type"] in ("message", "function_call") for i in self.items):
            out += self._start("message")  # an answer with no text still has its (empty) message
        return out + self._close(INCOMPLETE if cut(result) else COMPLETED)

    def reasoning_tokens(self, result: GenerationResult) -> int:
        if self._parser is None or self._options.fmt.reasoning is None:
            return 0
        return reasoning_tokens(["" if t.special else t.text for t in result.tokens], self._parser)

    def _on(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, CallStart):
            self.called = True
            return self._start("function_call", event.name)
        kind = {Reasoning: "reasoning", Content: "message", CallArguments: "function_call"}[type(event)]
        out = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        return out + [self._open.delta(event.text)]

    def _start(self, kind: str, name: str = "") -> list[dict[str, Any]]:
        out = self._close(COMPLETED)
        self._open = _Item(kind, self._count, name)
        self._count += 1
        return out + self._open.opening()

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        out = self._open.closing(status)
        self.items.append(out[-1]["item"])
        self._open = None
        return out


def cut(result: GenerationResult) -> bool:
    """The length cap ended the output (``max_output_tokens`` or the server's cap)."""
    return FinishReason(result.finish_reason) == FinishReason.LENGTH
