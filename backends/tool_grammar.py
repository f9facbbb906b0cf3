"""The grammar that enforces ``tool_choice`` "required" or a named function: the output is one call (or,
with parallel calls, one or more) in the model's tool-call syntax, each a JSON object whose ``name`` is
one of the tools and whose arguments follow that tool's JSON Schema; a reasoning block may come first.
In the generic format (``generic_tools.py``) the whole answer is one JSON object: the calls, or with
``auto`` a text response instead.

The service asks for it with ``tool_call_constraint`` (a ``Grammar`` of kind "tool_calls" holding the
request's part); ``backends/grammar.py`` turns it into a llguidance Lark grammar with ``tool_call_lark``,
which writes a marker (``<tool_call>``, ``</think>``) as the model's own token where the tokenizer has one,
so the model is held to the token it was trained to write, not to its spelling in pieces.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backends.chat_format import THINK, TOOL_CALL, ChatFormat, ToolCallSyntax
from backends.generic_tools import output_schema
from backends.types import Grammar

# What separates two calls (the model's own habit: Qwen writes each block on its line, Llama joins with "; ").
_SEPARATOR = {ToolCallSyntax.HERMES: "\n", ToolCallSyntax.LLAMA3_JSON: "; "}
_ARGUMENTS_KEY = {ToolCallSyntax.HERMES: "arguments", ToolCallSyntax.LLAMA3_JSON: "parameters"}


def tool_call_constraint(tools: Sequence[tuple[str, Mapping[str, Any]]], fmt: ChatFormat, *, parallel: bool,
                         thinking: bool = False, optional: bool = False) -> Grammar:
    """The constraint for calls of ``tools`` ((name, parameters schema) each); ``fmt.tool_calls`` must be set.
    With reasoning markers a reasoning block may come first (``thinking``: the prompt opened it, so the
    output starts inside it and must close it). ``optional`` (tool_choice auto with strict tools, Hermes
    syntax whose ``<tool_call>`` is a token): free text, and any call in it follows its schema; in the
    generic syntax: the answer is the calls or a text response."""
    assert fmt.tool_calls is not None, "a tool-call grammar needs a tool-call syntax"
    spec = {"tools": [[name, schema] for name, schema in tools], "syntax": fmt.tool_calls.value,
            "reasoning": fmt.reasoning is not None, "thinking": thinking, "parallel": parallel, "optional": optional}
    return Grammar("tool_calls", json.dumps(spec, separators=(",", ":")))


def tool_call_lark(spec_text: str, is_token: Callable[[str], bool], json_options: Mapping[str, Any]) -> str:
    """The Lark grammar of a ``tool_call_constraint``; ``is_token(text)``: the tokenizer has ``text`` as one
    special token; ``json_options``: llguidance's JSON options (whitespace, separators)."""
    spec = json.loads(spec_text)
    syntax = ToolCallSyntax(spec["syntax"])

    def literal(text: str) -> str:
        return f"<{text[1:-1]}>" if text.startswith("<") and is_token(text) else json.dumps(text)

    if syntax is ToolCallSyntax.GENERIC:  # one JSON object, the calls inside it
        body = {**output_schema(spec["tools"], parallel=spec["parallel"], optional=spec["optional"]),
                "x-guidance": dict(json_options)}
        call, calls = "body", "call"
    else:
        key = _ARGUMENTS_KEY[syntax]
        body = {"anyOf": [_call_schema(name, schema, key) for name, schema in spec["tools"]],
                "x-guidance": dict(json_options)}
        call = (f"{literal(TOOL_CALL.open)} {json.dumps(chr(10))} body {json.dumps(chr(10))} "
                f"{literal(TOOL_CALL.close)}" if syntax is ToolCallSyntax.HERMES else "body")
        calls = f"call ({json.dumps(_SEPARATOR[syntax])} call)*" if spec["parallel"] else "call"
    if spec.get("optional") and syntax is not ToolCallSyntax.GENERIC:
        if not literal(TOOL_CALL.open).startswith("<"):
            raise ValueError("strict tools with tool_choice auto need <tool_call> to be one token of the model")
        many = "*" if spec["parallel"] else "?"
        calls = f"TEXT? (call TEXT?){many}\nTEXT: /(.|\\n)+/"  # text cannot hold the <tool_call> token
    lines = ["%llguidance {}"]
    if spec["reasoning"]:
        opening = "" if spec["thinking"] else literal(THINK.open) + " "
        closing = literal(THINK.close)
        # Text up to the closing marker: a token the text cannot contain, or a string the text stops at.
        thought = (f"THOUGHT {closing}\nTHOUGHT: /(.|\\n)*/" if closing.startswith("<")
                   else f"thought {closing}\nthought[lazy]: /(.|\\n)*/")
        lines += [f"start: reasoning{'' if spec['thinking'] else '?'} {calls}",
                  f"reasoning: {opening}{thought}", "SPACE: /[ \\n]+/"]
    else:
        lines.append(f"start: {calls}")
    lines += [f"call: {call}", f"body: %json {json.dumps(body)}"]
    return "\n".join(lines) + "\n"


def _call_schema(name: str, parameters: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, key: parameters},
            "required": ["name", key], "additionalProperties": False}
