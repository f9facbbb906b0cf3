"""Tool calling and reasoning on /v1/chat/completions, response side: a chat's generated text, parsed by
``backends/chat_output.py``, as OpenAI's ``message`` (``content``, ``reasoning_content``, ``tool_calls``) or as
stream deltas (``delta.reasoning_content``, ``delta.content``, ``delta.tool_calls``: index, id, type and the
function's name first, then its ``arguments`` in pieces). One parser serves both, so a stream's arguments
joined equal the body's."""
from __future__ import annotations

import uuid
from typing import Any

from backends.chat_output import (CallArguments, CallStart, ChatOutputParser, Content, Event, Reasoning, fold,
                                  reasoning_tokens)
from backends.generic_output import GenericOutputParser
from backends.types import FinishReason, GenerationResult
from service.dialects.openai_tools import ChatOptions

TOOL_CALLS = "tool_calls"  # the finish_reason of an answer that calls tools


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parser(options: ChatOptions) -> ChatOutputParser | GenericOutputParser:
    return options.output_parser()


def _token_texts(result: GenerationResult) -> list[str]:
    return ["" if t.special else t.text for t in result.tokens]


def finish_reason(result: GenerationResult, called: bool, plain: str) -> str:
    """``tool_calls`` when the answer called tools and ended by itself (not at the length cap), else ``plain``."""
    return TOOL_CALLS if called and FinishReason(result.finish_reason) != FinishReason.LENGTH else plain


def render_message(options: ChatOptions, result: GenerationResult) -> tuple[dict[str, Any], bool, int]:
    """(the choice's message, whether it calls tools, its reasoning tokens)."""
    parser = _parser(options)
    output = fold([*parser.feed(result.generated_text), *parser.finish()], reasoned=parser.reasoned)
    message: dict[str, Any] = {"role": "assistant", "content": output.content or (None if output.calls else "")}
    if options.fmt.reasoning is not None:
        message["reasoning_content"] = output.reasoning or None
    if output.calls:
        message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in output.calls]
    return message, bool(output.calls), reasoning_tokens(_token_texts(result), parser)


class ChatDeltas:
    """One stream's parser: text in, OpenAI deltas out."""

    def __init__(self, options: ChatOptions) -> None:
        self._parser = _parser(options)
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [self._delta(e) for e in self._parser.feed(text)] if text else []

    def finish(self) -> list[dict[str, Any]]:
        return [self._delta(e) for e in self._parser.finish()]

    def reasoning_tokens(self, result: GenerationResult) -> int:
        return reasoning_tokens(_token_texts(result), self._parser)

    def _delta(self, event: Event) -> dict[str, Any]:
        if isinstance(event, Reasoning):
            return {"reasoning_content": event.text}
        if isinstance(event, Content):
            return {"content": event.text}
        if isinstance(event, CallStart):
            self.called = True
            return {"tool_calls": [{"index": event.index, "id": new_call_id(), "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        assert isinstance(event, CallArguments)
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
