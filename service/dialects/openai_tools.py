"""Tool calling and reasoning on /v1/chat/completions, request side: ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``chat_template_kwargs`` and ``thinking_budget`` → ``ChatOptions`` (what the template
gets, the grammar that enforces a required or named call, how the output is parsed); the messages of a
tool conversation (assistant ``tool_calls``, ``role: "tool"``) → what the chat template expects. A model
whose template has no tool syntax gets the generic format (``backends/generic_tools.py``): our system
message, the history in its convention, a grammar on every answer that may call tools.

``parse_chat_options`` is the entry point every dialect with tools goes through (chat, Responses, Messages).

The output's syntax is model logic (``backends/chat_format.py``, ``backends/chat_output.py``); this module
is the wire: OpenAI's field names and their errors (400 naming the field).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Any

from backends.base import Backend
from backends.chat_format import ChatFormat, ToolCallSyntax, chat_format, closes_reasoning, opens_reasoning
from backends.chat_output import ChatOutputParser
from backends.errors import BackendError
from backends.generic_output import GenericOutputParser, output_parser
from backends.generic_tools import generic_messages, system_prompt
from backends.grammar import GrammarRejected, check_json_schema
from backends.tool_grammar import tool_call_constraint
from backends.types import Grammar
from service.validation import show

# Template variables a request may not set through chat_template_kwargs (the server sets them).
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                         "raise_exception", "strftime_now"})
_PROBE = ({"role": "user", "content": "?"},)  # a conversation whose prompt shows how the template ends a turn


class ToolRequestError(ValueError):
    """A tool or reasoning field is wrong; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What a chat request asks of tools and reasoning, and what the model's format makes of it."""

    fmt: ChatFormat = ChatFormat()
    tools: tuple[dict[str, Any], ...] = ()  # as sent (for the template)
    choice: str = "auto"  # "none" | "auto" | "required" | a function's name
    parallel: bool = True
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    thinking: bool = False  # the prompt opens a reasoning block: the output starts inside it
    thinking_off: bool = False  # the prompt closed an empty reasoning block: the answer comes without one

    @property
    def parses(self) -> bool:
        """The output goes through the chat-output parser (tool calls may come, or the model reasons)."""
        return self.calls_allowed or self.fmt.reasoning is not None

    @property
    def calls_allowed(self) -> bool:
        return bool(self.tools) and self.choice != "none" and self.fmt.tool_calls is not None

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    @property
    def generic(self) -> bool:
        """The model's tools go through the generic format (its template knows none)."""
        return self.fmt.tool_calls is ToolCallSyntax.GENERIC

    def template_variables(self) -> dict[str, Any]:
        """The extra variables of the chat template: the tools (native formats) and chat_template_kwargs."""
        tools = {"tools": list(self.tools)} if self.tools and not self.generic else {}
        return {**dict(self.template_kwargs), **tools}

    def prompt_messages(self, messages: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        """The messages the template renders: as sent for a native format; in the generic format with our
        system message (when the model may call tools) and the tool turns in its convention."""
        if not self.generic:
            return messages
        functions = [t["function"] for t in self.tools]
        system = system_prompt(functions, self.choice, self.parallel) if self.calls_allowed else None
        return tuple(generic_messages(messages, system))

    def output_parser(self) -> ChatOutputParser | GenericOutputParser:
        """A new parser of one output (``feed``/``finish`` → reasoning, text and call events)."""
        return output_parser(self.fmt, thinking=self.thinking, tools=self.calls_allowed, max_calls=self.max_calls)


def parse_chat_options(body: dict[str, Any], backend: Backend,
                       formats: tuple[str, str] = ("auto", "auto")) -> tuple[ChatOptions, Grammar | None]:
    """The request's options and, for tool_choice required or named (or strict tools), the grammar that
    enforces the calls. ``formats``: the server config's toolCallFormat and reasoningFormat."""
    tools = tuple(body.get("tools") or ())
    names = [t["function"]["name"] for t in tools]
    for i, tool in enumerate(tools):
        if names.index(tool["function"]["name"]) != i:
            raise ToolRequestError(f"tools[{i}].function.name {show(names[i])} is the name of another tool too",
                                   f"tools[{i}].function.name")
        _check_schema(tool["function"].get("parameters"), f"tools[{i}].function.parameters")
    choice = _choice(body.get("tool_choice"), names)
    kwargs = body.get("chat_template_kwargs") or {}
    for key in kwargs:
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise ToolRequestError(f"chat_template_kwargs may not set {show(key)}, which the server sets",
                                   f"chat_template_kwargs.{key}")
    template = getattr(backend, "chat_template", None)
    fmt = chat_format(template, *formats)
    if tools and choice != "none" and fmt.tool_calls is None:
        raise ToolRequestError(f"model {show(backend.model_name)} has tool calls switched off (toolCallFormat "
                               "\"none\" in the server config); send tool_choice \"none\" or no tools", "tools")
    template_kwargs = tuple(sorted(kwargs.items()))
    thinking, off = _prompt_thinks(backend, json.dumps(kwargs, sort_keys=True), fmt)
    options = ChatOptions(fmt, tools, choice, body.get("parallel_tool_calls") is not False, template_kwargs, thinking,
                          off)
    grammar_fmt = replace(fmt, reasoning=None) if off else fmt  # thinking off: no reasoning block before calls
    strict = [t["function"] for t in tools if t["function"].get("strict")]
    if choice == "none" or (choice == "auto" and not strict and not options.generic):
        return options, None
    if choice == "auto":  # strict tools (generic format: all tools): any call the model makes follows its schema
        schemas = [(f["name"], f.get("parameters") or {"type": "object"})
                   for f in ([t["function"] for t in tools] if options.generic else strict)]
        return options, tool_call_constraint(schemas, grammar_fmt, parallel=options.parallel, thinking=thinking,
                                             optional=True)
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    schemas = [(f["name"], f.get("parameters") or {"type": "object"}) for f in chosen]
    return options, tool_call_constraint(schemas, grammar_fmt, parallel=options.parallel and choice == "required",
                                         thinking=thinking)


def _choice(value: Any, names: list[str]) -> str:
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, str):
        if value != "none" and not names:
            raise ToolRequestError(f"tool_choice {show(value)} needs tools; the request has none", "tool_choice")
        return value
    name = value["function"]["name"]
    if name not in names:
        known = ", ".join(map(show, names)) or "none"
        raise ToolRequestError(f"tool_choice names the function {show(name)}, which is not in tools (tools: {known})",
                               "tool_choice.function.name")
    return name


def _check_schema(schema: Any, field: str) -> None:
    if schema is None:
        return
    try:
        check_json_schema(schema)
    except GrammarRejected as exc:
        raise ToolRequestError(f"{field} does not compile: {exc}", field) from None


@functools.lru_cache(maxsize=64)
def _prompt_thinks(backend: Backend, kwargs_json: str, fmt: ChatFormat) -> tuple[bool, bool]:
    """Whether the template, with these chat_template_kwargs, opens a reasoning block at the start of the
    answer, and whether it closed an empty one (thinking off); decided on a one-message conversation, as
    templates decide it in the generation prompt."""
    if fmt.reasoning is None:
        return False, False
    try:
        prompt = backend.apply_chat_template(_PROBE, **json.loads(kwargs_json))
    except (BackendError, TypeError, ValueError, LookupError):  # a template that needs more: the real render tells
        return False, False
    return opens_reasoning(prompt, fmt), closes_reasoning(prompt, fmt)


def template_messages(messages: list[dict[str, Any]]) -> None:
    """Tool-call arguments as objects in place (the form HF templates write with ``tojson``); arguments that
    are not a JSON object stay text."""
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function", {})
            try:
                arguments = json.loads(function.get("arguments", ""))
            except (TypeError, ValueError):
                continue
            if isinstance(arguments, dict):
                function["arguments"] = arguments
