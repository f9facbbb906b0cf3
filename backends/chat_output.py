"""A chat model's output split into reasoning, answer text and tool calls, incrementally: ``feed`` it the
text as it is generated and it returns what that text settles (``Reasoning``, ``Content``, ``CallStart``,
``CallArguments`` events); a whole output is parsed by feeding it at once (``parse_chat_output``). One
parser for both, so a streamed call's arguments joined equal the non-streamed ones however the text was
split (tests/backends/test_chat_output.py splits at every position).

The rules (docs/tools-and-reasoning.md): reasoning is the text of a leading ``<think>…</think>`` block (or
from the start, when the prompt opened the block); answer text is the rest outside tool calls, with its
leading and trailing whitespace removed. A call's ``arguments`` are the model's own text of the arguments
object when the call is written ``{"name": …, "arguments": {…}}`` (streamed as it comes), else the object
re-serialized once the call is complete. A call that is not a JSON object with a string ``name`` and an
object ``arguments`` (or ``parameters``) is answer text, unless its name was already streamed.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from backends.chat_format import TOOL_CALL, ChatFormat, ToolCallSyntax


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str  # the next piece of the call's arguments (JSON text)


Event = Reasoning | Content | CallStart | CallArguments


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object (as written when it was streamed)


@dataclass(frozen=True, slots=True)
class ChatOutput:
    reasoning: str | None  # None: the output has no reasoning block
    content: str
    calls: tuple[ParsedCall, ...]


def parse_chat_output(text: str, fmt: ChatFormat, *, thinking: bool = False, tools: bool = False,
                      max_calls: int | None = None) -> ChatOutput:
    """The whole output ``text`` parsed (``ChatOutputParser`` fed at once)."""
    parser = ChatOutputParser(fmt, thinking=thinking, tools=tools, max_calls=max_calls)
    return fold([*parser.feed(text), *parser.finish()], reasoned=parser.reasoned)


def fold(events: Iterable[Event], *, reasoned: bool = False) -> ChatOutput:
    """The output the events describe."""
    reasoning, content, names, arguments = [], [], [], []
    for event in events:
        if isinstance(event, Reasoning):
            reasoning.append(event.text)
        elif isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            names.append(event.name)
            arguments.append([])
        else:
            arguments[event.index].append(event.text)
    calls = tuple(ParsedCall(n, "".join(a)) for n, a in zip(names, arguments))
    return ChatOutput("".join(reasoning) if reasoned else None, "".join(content), calls)


def reasoning_tokens(texts: Sequence[str], parser: ChatOutputParser) -> int:
    """How many of the generated tokens (each token's text, in order) were reasoning: those that began
    before the reasoning block closed (all, if it never closed)."""
    if not parser.reasoned:
        return 0
    if parser.reasoning_end is None:
        return len(texts)
    at, count = 0, 0
    for text in texts:
        if at >= parser.reasoning_end:
            break
        count += 1
        at += len(text)
    return count


class _Trimmed:
    """Text pieces with the leading whitespace dropped and trailing whitespace held until text follows it."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body


_START, _REASONING, _CONTENT, _CALL, _AFTER_CALL, _TEXT = range(6)
# A call written name first: the name, then where its arguments object begins (streamed from there).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class ChatOutputParser:
    """One output's parser. ``thinking``: the prompt opened a reasoning block (``opens_reasoning``);
    ``tools``: parse tool calls (the request has tools and lets the model call them); ``max_calls``: calls
    beyond it are dropped (``parallel_tool_calls`` false)."""

    def __init__(self, fmt: ChatFormat, *, thinking: bool = False, tools: bool = False,
                 max_calls: int | None = None) -> None:
        self._markers = fmt.reasoning
        self._syntax = fmt.tool_calls if tools else None
        self._mode = _REASONING if thinking and fmt.reasoning else _START if fmt.reasoning else _CONTENT
        self._max_calls = max_calls
        self._buf = ""
        self._fed = 0  # characters fed so far
        self._reasoning, self._content = _Trimmed(), _Trimmed()
        self._call: CallScanner | None = None
        self._calls = 0
        self.reasoned = self._mode == _REASONING  # the output has a reasoning block
        self.reasoning_end: int | None = None  # characters of output up to the end of the block, once closed

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._fed += len(text)
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        """The output ended: what is still held is settled."""
        out: list[Event] = []
        rest, self._buf = self._buf, ""
        if self._mode == _REASONING:
            self._reason(out, rest)
        elif self._mode in (_CONTENT, _TEXT):
            self._say(out, rest)
        elif self._mode == _CALL and self._call is not None:
            self._call_failed(out, self._call, finished=False)
        return out

    # --- one step of the state machine: True if it changed state and should run again ---

    def _step(self, out: list[Event]) -> bool:
        mode = self._mode
        if mode == _START:
            return self._start()
        if mode == _REASONING:
            return self._in_reasoning(out)
        if mode == _CONTENT:
            return self._in_content(out)
        if mode == _CALL:
            return self._in_call(out)
        if mode == _AFTER_CALL:
            return self._after_call()
        self._say(out, self._buf)
        self._buf = ""
        return False

    def _start(self) -> bool:
        """Before any output: a reasoning block opens here, or there is none."""
        head, opening = self._buf.lstrip(), self._markers.open
        if head.startswith(opening):
            self._buf, self._mode, self.reasoned = head[len(opening):], _REASONING, True
            return True
        if not head or opening.startswith(head):
            return False  # undecided yet
        self._mode = _CONTENT
        return True

    def _in_reasoning(self, out: list[Event]) -> bool:
        closing = self._markers.close
        at = self._buf.find(closing)
        if at < 0:
            keep = _partial_suffix(self._buf, closing)
            self._reason(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._reason(out, self._buf[:at])
        self._buf = self._buf[at + len(closing):]
        self.reasoning_end = self._fed - len(self._buf)
        self._mode = _CONTENT
        return True

    def _in_content(self, out: list[Event]) -> bool:
        if self._syntax is None:
            self._mode = _TEXT
            return True
        if self._syntax is ToolCallSyntax.LLAMA3_JSON:  # a call is the whole answer, or there is none
            head = self._buf.lstrip()
            if not head:
                return False
            self._mode = _TEXT
            if head.startswith("{"):
                self._buf = head
                self._open_call()
            return True
        at = self._buf.find(TOOL_CALL.open)
        if at < 0:
            keep = _partial_suffix(self._buf, TOOL_CALL.open)
            self._say(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._say(out, self._buf[:at])
        self._buf = self._buf[at + len(TOOL_CALL.open):]
        self._open_call()
        return True

    def _open_call(self) -> None:
        emit = self._max_calls is None or self._calls < self._max_calls
        self._call = CallScanner(self._calls if emit else -1)
        self._mode = _CALL

    def _in_call(self, out: list[Event]) -> bool:
        call = self._call
        chunk, self._buf = self._buf, ""
        events = call.feed(chunk)
        if call.index >= 0:
            out.extend(events)
        if call.failed:
            self._call_failed(out, call, finished=True)
            return True
        if call.end is None:
            return False
        if call.index >= 0:
            done = call.complete()
            if done is None:
                self._call_failed(out, call, finished=True)
                return True
            out.extend(done)
            self._calls += 1
        self._buf, self._call, self._mode = call.text[call.end:], None, _AFTER_CALL
        return True

    def _call_failed(self, out: list[Event], call: CallScanner, *, finished: bool) -> None:
        """Not a call after all: its text is answer text (or it is dropped, when its name was streamed or it
        is over ``max_calls``); after a finished one the text is read again as answer text."""
        self._call = None
        tag = TOOL_CALL.open if self._syntax is ToolCallSyntax.HERMES else ""
        if call.name is not None or call.index < 0:
            self._calls += call.name is not None
            self._mode, self._buf = _AFTER_CALL, (call.text[call.end:] if call.end is not None else "")
            return
        if not finished:
            self._say(out, tag + call.text)
            return
        self._say(out, tag)
        self._buf = call.text + self._buf
        self._mode = _CONTENT if self._syntax is ToolCallSyntax.HERMES else _TEXT

    def _after_call(self) -> bool:
        """Between calls: Hermes skips to the closing tag; Llama-3 JSON takes ``;`` and the next call."""
        if self._syntax is ToolCallSyntax.HERMES:
            at = self._buf.find(TOOL_CALL.close)
            if at < 0:
                self._buf = self._buf[len(self._buf) - _partial_suffix(self._buf, TOOL_CALL.close):]
                return False
            self._buf, self._mode = self._buf[at + len(TOOL_CALL.close):], _CONTENT
            return True
        head = self._buf.lstrip()
        if not head:
            self._buf = ""
            return False
        if head.startswith(";"):
            self._buf = head[1:]
            return True
        self._buf = head
        if head.startswith("{"):
            self._open_call()
        else:
            self._mode = _TEXT
        return True

    def _reason(self, out: list[Event], text: str) -> None:
        if text := self._reasoning.push(text):
            out.append(Reasoning(text))

    def _say(self, out: list[Event], text: str) -> None:
        if text := self._content.push(text):
            out.append(Content(text))


class CallScanner:
    """One call's JSON object, character by character: where it ends, and (written name first) its name and
    the arguments text as it comes. ``index`` -1: a call beyond ``max_calls`` (scanned, never reported)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.name: str | None = None  # set once streamed
        self.failed = False  # the text does not start a JSON object
        self.end: int | None = None  # the object's end in ``text``
        self._pos = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._sent = 0

    def feed(self, chunk: str) -> list[Event]:
        self.text += chunk
        out: list[Event] = []
        if self.name is None and (head := _HEAD.match(self.text)) is not None:
            try:
                self.name = json.loads(head.group(1))
            except ValueError:
                pass
            else:
                self._args_start = self._sent = head.end()
                out.append(CallStart(self.index, self.name))
        self._scan()
        if self._args_start is not None:
            stop = self._args_end if self._args_end is not None else self._pos
            if stop > self._sent:
                out.append(CallArguments(self.index, self.text[self._sent:stop]))
                self._sent = stop
        return out

    def _scan(self) -> None:
        text = self.text
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif self._depth == 0:
                if c.isspace():
                    continue
                if c != "{":
                    self.failed, self._pos = True, i
                    return
                self._depth = 1
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and self._args_start is not None and self._args_end is None \
                        and i >= self._args_start:
                    self._args_end = i + 1
                if self._depth == 0:
                    self.end = self._pos = i + 1
                    return
        self._pos = len(text)

    def complete(self) -> list[Event] | None:
        """The finished object's remaining events (a call not written name first: all of them at once);
        None if it is not a call."""
        if self.name is not None:
            return []
        try:
            call = json.loads(self.text[:self.end])
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters"))
        if not isinstance(arguments, dict):
            return None
        self.name = call["name"]
        return [CallStart(self.index, self.name), CallArguments(self.index, json.dumps(arguments, ensure_ascii=False))]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (it may be completed by more text)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
