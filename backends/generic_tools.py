"""The generic tool-call format, for a model whose chat template has no tool syntax of its own (as
llama.cpp's generic format): the tools described in a system message we write, the answer held by the
grammar to one JSON object — ``{"tool_calls": [{"name": …, "arguments": {…}}]}`` or ``{"response": "…"}`` —
and a tool conversation's history written in that convention. The answer's parser: ``generic_output.py``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

CALLS, RESPONSE, RESULTS = "tool_calls", "response", "tool_results"
_COMPACT = (",", ":")  # the grammar's JSON spacing (backends/grammar.py JSON_OPTIONS): history reads the same
_INTRO = ("You can call tools. Each tool is a function, given as its name, its description and the JSON Schema "
          "of its arguments:")
_CALL_SHAPE = '{"tool_calls":[{"name":"<tool name>","arguments":{<arguments>}}]}'
_MANY = " (one object in tool_calls per call; several to call several tools)"
_RESULTS_NOTE = ('Tool results come back in a user message as {"tool_results":[{"tool_call_id":"…","name":"…",'
                 '"content":"…"}]}.')


def system_prompt(tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool) -> str:
    """Our system message for ``tools`` (OpenAI function objects: name, description, parameters) and
    ``tool_choice`` (``auto``, ``required`` or a function's name; ``parallel``: more than one call allowed)."""
    lines = [_INTRO, *(_tool_line(t) for t in tools), ""]
    calls = _CALL_SHAPE + (_MANY if parallel and choice in ("auto", "required") else " (exactly one call)")
    if choice == "auto":
        lines.append(f"Answer with one JSON object: either {calls} to call tools, or "
                     '{"response":"<your answer>"} to answer the user directly.')
    elif choice == "required":
        lines.append(f"Answer with one JSON object that calls tools: {calls}.")
    else:
        lines.append(f"Answer with one JSON object that calls the tool {json.dumps(choice)}: "
                     f'{{"tool_calls":[{{"name":{json.dumps(choice)},"arguments":{{<arguments>}}}}]}}.')
    lines.append(_RESULTS_NOTE)
    return "\n".join(lines)


def _tool_line(function: Mapping[str, Any]) -> str:
    tool = {"name": function["name"], "description": function.get("description") or "",
            "parameters": function.get("parameters") or {"type": "object"}}
    return json.dumps(tool, ensure_ascii=False, separators=_COMPACT)


def generic_messages(messages: Sequence[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """``messages`` for a template without tool support: ``system`` (our prompt; None: no tools offered)
    merged into the request's system message or put first; an assistant message's ``tool_calls`` written
    as its content in the answer's JSON; consecutive ``tool`` messages one user message of their results."""
    names = {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            result = {"tool_call_id": message.get("tool_call_id"), "name": names.get(message.get("tool_call_id")),
                      "content": message.get("content") or ""}
            result = {k: v for k, v in result.items() if v is not None}
            if out and out[-1].get(RESULTS) is not None:
                out[-1][RESULTS].append(result)
            else:
                out.append({"role": "user", RESULTS: [result]})
        elif message.get("tool_calls"):
            out.append({key: value for key, value in message.items() if key != "tool_calls"}
                       | {"content": _calls_text(message)})
        else:
            out.append(dict(message))
    out = [_results_message(m) if RESULTS in m else m for m in out]
    if system is None:
        return out
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}, *out[1:]]
    return [{"role": "system", "content": system}, *out]


def _calls_text(message: Mapping[str, Any]) -> str:
    """An assistant turn's calls as the answer JSON (its text, if any, as the response beside them)."""
    calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
             for c in message["tool_calls"]]
    text = {RESPONSE: message["content"]} if message.get("content") else {}
    return json.dumps({**text, CALLS: calls}, ensure_ascii=False, separators=_COMPACT)


def _arguments(arguments: Any) -> Any:
    """A call's arguments as an object where they are JSON text of one, else as sent."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


def _results_message(message: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": json.dumps({RESULTS: message[RESULTS]}, ensure_ascii=False,
                                                  separators=_COMPACT)}


def output_schema(tools: Sequence[tuple[str, Mapping[str, Any]]], *, parallel: bool, optional: bool
                  ) -> dict[str, Any]:
    """The JSON Schema of the answer: calls of ``tools`` ((name, parameters schema) each; one call unless
    ``parallel``), or, when ``optional`` (tool_choice auto), a text response instead."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": dict(schema)},
              "required": ["name", "arguments"], "additionalProperties": False} for name, schema in tools]
    items: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                             "minItems": 1}
    if not parallel:
        items["maxItems"] = 1
    call = {"type": "object", "properties": {CALLS: items}, "required": [CALLS], "additionalProperties": False}
    if not optional:
        return call
    text = {"type": "object", "properties": {RESPONSE: {"type": "string"}}, "required": [RESPONSE],
            "additionalProperties": False}
    return {"anyOf": [call, text]}
