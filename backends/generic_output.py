"""The generic format's answer (``generic_tools.py``) read as it is generated: ``{"response": "…"}`` becomes
``Content`` events carrying the string's text (unescaped, as each piece settles: the JSON wrapper never
shows), ``{"tool_calls": [{"name": …, "arguments": {…}}, …]}`` becomes ``CallStart`` and ``CallArguments``
events (the arguments as the model wrote them, streamed). A leading reasoning block is read first by the
ordinary parser; an answer that is not that JSON (the grammar prevents it) is answer text as written.

``output_parser`` is the one place that picks the parser of a chat's output for its format.
"""
from __future__ import annotations

import re
from dataclasses import replace

from backends.chat_format import ChatFormat, ToolCallSyntax
from backends.chat_output import CallScanner, ChatOutputParser, Content, Event, Reasoning
from backends.generic_tools import CALLS, RESPONSE

_HEAD = re.compile(r'\s*\{\s*"(' + RESPONSE + "|" + CALLS + r')"\s*:\s*')
_HEADS = (f'{{"{RESPONSE}":', f'{{"{CALLS}":')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEAD_MODE, _QUOTE, _TEXT, _LIST, _NEXT, _CALL, _BETWEEN, _DONE, _RAW = range(9)


def output_parser(fmt: ChatFormat, *, thinking: bool = False, tools: bool = False,
                  max_calls: int | None = None) -> ChatOutputParser | GenericOutputParser:
    """The parser of a chat's output: the generic one when tools may be called in the generic format."""
    if tools and fmt.tool_calls is ToolCallSyntax.GENERIC:
        return GenericOutputParser(fmt, thinking=thinking, max_calls=max_calls)
    return ChatOutputParser(fmt, thinking=thinking, tools=tools, max_calls=max_calls)


class GenericOutputParser:
    """One generic answer's parser, with ``ChatOutputParser``'s interface (``feed``, ``finish``,
    ``reasoned``, ``reasoning_end``). ``max_calls``: calls beyond it are dropped."""

    def __init__(self, fmt: ChatFormat, *, thinking: bool = False, max_calls: int | None = None) -> None:
        self._outer = ChatOutputParser(replace(fmt, tool_calls=None), thinking=thinking)  # reasoning, then text
        self._max_calls = max_calls
        self._mode = _HEAD_MODE
        self._buf = ""
        self._call: CallScanner | None = None
        self._calls = 0

    @property
    def reasoned(self) -> bool:
        return self._outer.reasoned

    @property
    def reasoning_end(self) -> int | None:
        return self._outer.reasoning_end

    def feed(self, text: str) -> list[Event]:
        return self._route(self._outer.feed(text))

    def finish(self) -> list[Event]:
        out = self._route(self._outer.finish())
        if self._mode in (_HEAD_MODE, _RAW) and self._buf:  # cut before the answer's shape showed
            out.append(Content(self._buf))
        self._buf, self._mode = "", _DONE
        return out

    def _route(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, Reasoning):
                out.append(event)
                continue
            self._buf += event.text
            while self._step(out):
                pass
        return out

    # --- one step: True if it changed state and should run again ---

    def _step(self, out: list[Event]) -> bool:
        mode = self._mode
        if mode == _HEAD_MODE:
            return self._head()
        if mode == _TEXT:
            return self._text(out)
        if mode in (_QUOTE, _LIST, _NEXT, _BETWEEN):
            return self._punctuation()
        if mode == _CALL:
            return self._in_call(out)
        if mode == _RAW and self._buf:
            out.append(Content(self._buf))
        self._buf = ""
        return False

    def _head(self) -> bool:
        found = _HEAD.match(self._buf)
        if found is not None:
            self._buf = self._buf[found.end():]
            self._mode = _QUOTE if found.group(1) == RESPONSE else _LIST
            return True
        compact = re.sub(r"\s+", "", self._buf)
        if not any(head.startswith(compact) for head in _HEADS):
            self._mode = _RAW
            return True
        return False  # undecided yet

    def _text(self, out: list[Event]) -> bool:
        """Inside the response string: its settled text."""
        text, used, closed = _unescape(self._buf)
        self._buf = self._buf[used:]
        if text:
            out.append(Content(text))
        if closed:
            self._mode, self._buf = _DONE, ""
        return False

    def _punctuation(self) -> bool:
        """The response string's opening quote; between the calls: ``[`` opens the list, ``{`` a call, ``,``
        comes between two, ``]`` ends it."""
        head = self._buf.lstrip()
        if not head:
            self._buf = ""
            return False
        expected = {_QUOTE: '"', _LIST: "[", _NEXT: "{", _BETWEEN: ",]"}[self._mode]
        if head[0] not in expected:
            self._mode = _DONE
            return True
        if self._mode == _NEXT:
            emit = self._max_calls is None or self._calls < self._max_calls
            self._call, self._buf, self._mode = CallScanner(self._calls if emit else -1), head, _CALL
            return True
        self._buf = head[1:]
        self._mode = _TEXT if head[0] == '"' else _NEXT if head[0] in "[," else _DONE
        return True

    def _in_call(self, out: list[Event]) -> bool:
        call = self._call
        chunk, self._buf = self._buf, ""
        events = call.feed(chunk)
        if call.index >= 0:
            out.extend(events)
        if call.failed:
            self._mode = _DONE
            return False
        if call.end is None:
            return False
        done = call.complete()
        if call.index >= 0 and done:
            out.extend(done)
        self._calls += call.name is not None
        self._buf, self._call, self._mode = call.text[call.end:], None, _BETWEEN
        return True


def _unescape(raw: str) -> tuple[str, int, bool]:
    """(the text of a JSON string's settled beginning ``raw``, the characters of ``raw`` it used, whether the
    closing quote was reached); an escape not yet complete is left for more text."""
    out, i = [], 0
    while i < len(raw):
        c = raw[i]
        if c == '"':
            return "".join(out), i + 1, True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(raw):
            break
        if raw[i + 1] != "u":
            out.append(_ESCAPES.get(raw[i + 1], raw[i + 1]))
            i += 2
            continue
        code = _hex4(raw, i + 2)
        if code is None:
            break
        if 0xD800 <= code < 0xDC00 and raw[i + 6:i + 8] in ("\\u", "\\", ""):  # maybe a pair: its low half next
            low = _hex4(raw, i + 8) if raw[i + 6:i + 8] == "\\u" else None
            if low is None:
                break
            if 0xDC00 <= low < 0xE000:
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
                continue
        out.append("\ufffd" if 0xD800 <= code < 0xE000 else chr(code))  # a lone half: no character
        i += 6
    return "".join(out), i, False


def _hex4(raw: str, at: int) -> int | None:
    """The 4 hex digits at ``at`` (None: not all there yet)."""
    digits = raw[at:at + 4]
    return int(digits, 16) if len(digits) == 4 and all(d in "0123456789abcdefABCDEF" for d in digits) else None
