"""The chat-output parser on hand-written outputs: every split of the text (two pieces at every position,
and one character at a time) gives the same reasoning, content and calls as the whole text, and these equal
what an independent reading (regular expressions and json, here) finds."""
from __future__ import annotations

import json
import re

import pytest

from backends.chat_format import THINK, ChatFormat, ToolCallSyntax, chat_format
from backends.chat_output import ChatOutputParser, ParsedCall, fold, parse_chat_output, reasoning_tokens

QWEN = ChatFormat(ToolCallSyntax.HERMES, THINK)
LLAMA = ChatFormat(ToolCallSyntax.LLAMA3_JSON, None)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris\\"", "x": [1, {"a": "]"}]}}\n</tool_call>'
OUTPUTS = [
    (QWEN, "<think>\nLet me see.\n</think>\n\nSure.\n" + CALL),
    (QWEN, "Text before a call. " + CALL + "\n" + CALL.replace("get_weather", "f2")),
    (QWEN, '<tool_call>\n{"arguments": {"q": 1}, "name": "late_name"}\n</tool_call>'),
    (QWEN, "<think>never closed"),
    (QWEN, "no call <tool_ at all"),
    (QWEN, "<tool_call>not json</tool_call> tail"),
    (LLAMA, ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'),
    (LLAMA, 'plain answer {"name": "f"}'),
]


def independent(fmt: ChatFormat, text: str) -> tuple[str | None, str, list[tuple[str, dict]]]:
    reasoning = None
    if fmt.reasoning and (m := re.match(r"\s*<think>(.*?)(</think>|$)", text, re.S)):
        reasoning, text = m.group(1).strip(), text[m.end():]
    if fmt.tool_calls is ToolCallSyntax.LLAMA3_JSON:
        if not text.lstrip().startswith("{"):
            return reasoning, text.strip(), []
        calls = [json.loads(part) for part in re.split(r"\s*;\s*", text.strip())]
        return reasoning, "", [(c["name"], c["parameters"]) for c in calls]
    calls, content = [], text
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        calls.append((call["name"], call["arguments"]))
        content = content.replace(f"<tool_call>{body}</tool_call>", "", 1)
    return reasoning, content.strip(), calls


def run(fmt: ChatFormat, pieces: list[str]):
    parser = ChatOutputParser(fmt, tools=True)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return fold(events, reasoned=parser.reasoned)


@pytest.mark.parametrize("fmt, text", OUTPUTS)
def test_every_split_gives_the_whole_texts_parse(fmt, text):
    whole = parse_chat_output(text, fmt, tools=True)
    for at in range(len(text) + 1):
        assert run(fmt, [text[:at], text[at:]]) == whole, at
    assert run(fmt, list(text)) == whole


@pytest.mark.parametrize("fmt, text", OUTPUTS)
def test_the_parse_equals_an_independent_reading(fmt, text):
    out = parse_chat_output(text, fmt, tools=True)
    reasoning, content, calls = independent(fmt, text)
    assert (out.reasoning or None) == (reasoning or None) and out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls


def test_streamed_arguments_are_the_models_own_text():
    out = parse_chat_output(CALL, QWEN, tools=True)
    assert out.calls == (ParsedCall("get_weather", '{"city": "Pa}ris\\"", "x": [1, {"a": "]"}]}'),)


def test_max_calls_drops_later_calls_and_no_tools_keeps_the_text():
    assert len(parse_chat_output(CALL + CALL, QWEN, tools=True, max_calls=1).calls) == 1
    assert parse_chat_output(CALL, QWEN, tools=False).content == CALL


def test_a_prompt_that_opened_the_block_starts_in_reasoning_and_counts_tokens():
    parser = ChatOutputParser(QWEN, thinking=True)
    events = parser.feed("a b</think>answer") + parser.finish()
    assert fold(events, reasoned=True).reasoning == "a b" and parser.reasoning_end == len("a b</think>")
    assert reasoning_tokens(["a", " b", "</think>", "answer"], parser) == 3


def test_formats_come_from_the_template():
    assert chat_format("...<tool_call>...<think>") == QWEN
    assert chat_format("{{ '<|python_tag|>' }}") == LLAMA
    assert chat_format("plain") == ChatFormat(ToolCallSyntax.GENERIC)  # a template without a tool syntax
    assert chat_format("<tool_call>", "generic") == ChatFormat(ToolCallSyntax.GENERIC)
    assert chat_format("<tool_call>", "none", "none") == ChatFormat()
