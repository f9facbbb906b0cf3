"""Per-request stopping (checked in the fixed order length → eos → stop sequence).

Stop strings match anywhere in the incrementally decoded text; the match and all after
it are cut. Text that may still begin a stop string is held back until it cannot.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from backends.types import FinishReason


@dataclass(frozen=True, slots=True)
class StepOutcome:
    emit_text: str  # output text released by this step ("" while held back)
    finish: FinishReason | None  # None = keep generating


class Stopper:
    """Feed every generated token with ``push``; stop when it returns a finish reason.

    Precedence, for the token just pushed (counted first, EOS included):
      1. count == max_new_tokens → length (even if the token is EOS or ends a stop string);
      2. token in eos_ids        → eos_token;
      3. a stop string matched   → stop_sequence.
    Whatever the reason, the output is cut before the first stop string to complete
    (earliest end; the longest one if several end together), EOS text is never part of
    it, and held-back text is released. The released texts concatenate to the output.
    """

    def __init__(self, max_new_tokens: int, eos_ids: Iterable[int] = (), stop: Iterable[str] = ()) -> None:
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset(eos_ids)
        stops = tuple(stop)
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self._matcher = _StopMatcher(stops) if stops else None
        self._text = ""  # decoded output so far, EOS excluded
        self._released = 0  # length of the prefix of _text already emitted
        self._cut: int | None = None  # where the output ends once a stop string matched
        self.generated_tokens = 0
        self.finish: FinishReason | None = None

    @property
    def generated_text(self) -> str:
        """The output released so far; after the finish, the final generated text."""
        return self._text[: self._released]

    def push(self, token_id: int, text_delta: str) -> StepOutcome:
        if self.finish is not None:
            raise RuntimeError(f"push() after the request finished ({self.finish.value})")
        self.generated_tokens += 1
        is_eos = token_id in self.eos_ids
        if not is_eos:
            self._append(text_delta)
        if self.generated_tokens >= self.max_new_tokens:
            return self._end(FinishReason.LENGTH)
        if is_eos:
            return self._end(FinishReason.EOS_TOKEN)
        if self._cut is not None:
            return self._end(FinishReason.STOP_SEQUENCE)
        held = self._matcher.held if self._matcher else 0
        return StepOutcome(self._release(len(self._text) - held), None)

    def cancel(self) -> StepOutcome:
        """End a request stopped from outside (client gone, shutdown): stop_sequence."""
        return self._end(FinishReason.STOP_SEQUENCE)

    def _append(self, delta: str) -> None:
        if self._matcher is None or self._cut is not None:
            self._text += delta
            return
        for i, char in enumerate(delta):
            matched = self._matcher.feed(char)
            if matched:
                self._text += delta[: i + 1]
                self._cut = len(self._text) - matched
                return
        self._text += delta

    def _end(self, reason: FinishReason) -> StepOutcome:
        end = len(self._text) if self._cut is None else self._cut
        self._text = self._text[:end]
        self.finish = reason
        return StepOutcome(self._release(end), reason)

    def _release(self, end: int) -> str:
        end = max(end, self._released)
        text, self._released = self._text[self._released : end], end
        return text


class _StopMatcher:
    """Aho–Corasick automaton over the stop strings, fed one character at a time.

    Its state is the longest suffix of the text that is a prefix of a stop string:
    ``held`` is that suffix's length, i.e. the text that must not be released yet.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._fail = [0]
        self._match = [0]  # length of the longest stop string ending at this state
        for stop in stops:
            self._insert(stop)
        self._link()
        self._state = 0

    @property
    def held(self) -> int:
        return self._depth[self._state]

    def feed(self, char: str) -> int:
        """Advance by one character; return the length of a stop string ending here (0: none)."""
        state = self._state
        while state and char not in self._goto[state]:
            state = self._fail[state]
        self._state = self._goto[state].get(char, 0)
        return self._match[self._state]

    def _insert(self, stop: str) -> None:
        node = 0
        for char in stop:
            if char not in self._goto[node]:
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._fail.append(0)
                self._match.append(0)
                self._goto[node][char] = len(self._goto) - 1
            node = self._goto[node][char]
        self._match[node] = len(stop)

    def _link(self) -> None:
        queue = deque(self._goto[0].values())  # depth-1 nodes fail to the root
        while queue:
            node = queue.popleft()
            for char, child in self._goto[node].items():
                queue.append(child)
                fail = self._fail[node]
                while fail and char not in self._goto[fail]:
                    fail = self._fail[fail]
                self._fail[child] = self._goto[fail].get(char, 0)
                self._match[child] = self._match[child] or self._match[self._fail[child]]
