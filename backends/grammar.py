"""Constrained decoding with llguidance: a request's grammar (JSON Schema or regex) compiled against the
model's tokenizer into a matcher, whose token mask restricts each step's choice.

Bounds (docs/structured-output.md): the grammar text is at most ``MAX_GRAMMAR_BYTES``; compilation runs
under llguidance's fuel limits (``LIMITS``), so a schema too large or too slow to compile is refused in
well under a second instead of holding a worker; each mask step is bounded by the step fuel.
``GrammarCompiler.check`` is the trial the service runs before a request takes a slot: compile, then the
first ``CHECK_STEPS`` masks and tokens, where llguidance's lexer meets its limits (``a{1000000}`` compiles,
then fails at its first token); a grammar over a limit is refused in our words, never with its lexer state.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

from backends.errors import ParameterRejected
from backends.tool_grammar import tool_call_lark
from backends.types import Grammar

MAX_GRAMMAR_BYTES = 65_536  # the serialized schema or the regex
# llguidance's own resource limits (its defaults, spelled out): fuel bounds the compile and each mask step.
# verbose_errors off: an error never carries the parser's state or the grammar back to the client.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_grammar_size=500_000, max_lexer_states=250_000, verbose_errors=False)
CHECK_STEPS = 2  # masks (and tokens) the trial run computes: the lexer's limits show by the first token
# llguidance's messages for a grammar over one of its limits -> what we tell the client instead
_OVER_LIMIT = (
    (("too many expressions constructed", "too many states", "LexerTooComplex"),
     "is too complex for the grammar engine: its lexer would build more states than its limit (use smaller "
     "repetition counts or a simpler pattern)"),
    (("recursion limit exceeded", "NestLimitExceeded", "StackOverflow"),
     "nests too deeply for the grammar engine"),
    (("fuel", "Too many items"),
     "is too costly for the grammar engine to prepare within its work limits"),
    (("too big", "too large", "ExceededSizeLimit"),
     "is larger than the grammar engine's size limit"),
)
# Compact JSON: a small model left free whitespace can pad forever between tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
ANY_JSON_OBJECT = '{"type": "object"}'


class GrammarRejected(ParameterRejected):
    """The request's grammar does not compile (or is over a bound); the message is the compiler's."""

    def __init__(self, message: str) -> None:
        super().__init__("grammar", message)


@dataclass(slots=True)
class MaskStats:
    """What mask computation cost: its wall time and the masks computed (one per constrained token)."""

    seconds: float = 0.0
    masks: int = 0
    batches: int = 0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / max(self.masks, 1)


class GrammarCompiler:
    """Compiles requests' grammars for one model: the llguidance tokenizer is built once, on first use
    (about half a second for a 49k vocabulary), from the model's tokenizer.json text. ``tokenizer_json`` is that
    text, or a function giving it, called on first use too (the engine's: a 262k vocabulary's tokenizer.json is
    33 MB, serialized in half a second of CPU and held for nothing by a server that never sees a grammar)."""

    def __init__(self, tokenizer_json: str | Callable[[], str | None] | None, vocab_size: int,
                 eos_ids: Iterable[int]) -> None:
        self._json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if callable(self._json):
                self._json = self._json()
            if self._json is None:
                raise GrammarRejected("this model's tokenizer has no tokenizer.json, which grammars need")
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._json, n_vocab=self._vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer

    def compile(self, grammar: Grammar) -> GrammarState:
        """The matcher for ``grammar`` in its start state; ``GrammarRejected`` with the compiler's message."""
        if len(grammar.value.encode("utf-8")) > MAX_GRAMMAR_BYTES:
            raise GrammarRejected(f"the {grammar.kind} grammar is {len(grammar.value.encode('utf-8'))} bytes, "
                                  f"more than the limit of {MAX_GRAMMAR_BYTES}")
        if grammar.kind == "tool_calls":
            try:
                text = tool_call_lark(grammar.value, self._is_token, JSON_OPTIONS)
            except ValueError as exc:
                raise GrammarRejected(str(exc)) from None
        else:
            text = _llguidance_grammar(grammar)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise _rejection(grammar, matcher.get_error())
        return GrammarState(matcher, self._vocab_size)

    def _is_token(self, text: str) -> bool:
        """``text`` is one special token of this tokenizer (a Lark grammar names it as ``<text>``)."""
        ids = self.tokenizer.tokenize_str(text)
        return len(ids) == 1 and self.tokenizer.is_special_token(ids[0])

    def check(self, grammar: Grammar) -> None:
        """``GrammarRejected`` unless ``grammar`` compiles and its first ``CHECK_STEPS`` steps (mask, then an
        allowed token consumed) stay within llguidance's limits. Runs on the calling thread, bounded by the
        compile and step fuel (``LIMITS``): well under a second for the worst grammar we know of."""
        state = self.compile(grammar)
        for pattern in _schema_patterns(grammar):  # a string's pattern is lexed only once generation gets there
            try:
                self.check(Grammar("regex", pattern))
            except GrammarRejected as exc:
                raise GrammarRejected(f"the JSON Schema has a pattern {pattern[:40]!r}{'…' * (len(pattern) > 40)} "
                                      f"that {str(exc).removeprefix('the regex ')}") from None
        mask = allocate_token_bitmask(1, self._vocab_size)
        for _ in range(CHECK_STEPS):
            fill_next_token_bitmask(state.matcher, mask, 0)
            if state.matcher.is_error():
                break
            state.bitmask = mask[0]
            allowed = np.flatnonzero(state.allowed())
            choices = [int(t) for t in allowed if int(t) not in self._eos] or [int(t) for t in allowed]
            if not choices or state.matcher.is_stopped():
                return
            state.matcher.consume_token(choices[0])
            if state.matcher.is_error():
                break
        if state.matcher.is_error():
            raise _rejection(grammar, state.matcher.get_error())


class GrammarState:
    """One request's grammar: the matcher, advanced by each chosen token, and its latest mask."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask: np.ndarray | None = None  # [ceil(V/32)] int32, set by MaskBatch

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next: bool [V] (EOS once the grammar may end)."""
        assert self.bitmask is not None, "the mask of this step was not computed"
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar would take in turn from its state, without advancing it (a draft
        is cut there: the token after would be refused)."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def advance(self, token_id: int) -> None:
        """Consume the chosen token; a token the grammar refuses is an error (the mask prevents it)."""
        self.bitmask = None
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            raise RuntimeError(f"the grammar refused token {token_id}: {self.matcher.get_error()}")


class MaskBatch:
    """Masks for the constrained rows of one step, computed on a worker thread while the forward pass
    runs (llguidance releases the GIL); ``wait`` before sampling the first of them."""

    def __init__(self, pool: ThreadPoolExecutor, executor: llguidance.LLExecutor, states: list[GrammarState],
                 stats: MaskStats) -> None:
        self._states = states
        self._future: Future | None = pool.submit(self._compute, executor, stats) if states else None

    def _compute(self, executor: llguidance.LLExecutor, stats: MaskStats) -> None:
        started = time.perf_counter()
        masks = allocate_token_bitmask(len(self._states), self._states[0].vocab_size)
        fill_next_token_bitmask_par(executor, [(s.matcher, i) for i, s in enumerate(self._states)], masks)
        for state, row in zip(self._states, masks):
            state.bitmask = row
        stats.seconds += time.perf_counter() - started
        stats.masks += len(self._states)
        stats.batches += 1

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()
            self._future = None


class MaskWorker:
    """The engine's mask thread and llguidance executor, and the running cost of masks."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mindserve-masks")
        self._executor = llguidance.LLExecutor(num_threads=1)
        self.stats = MaskStats()

    def start(self, states: list[GrammarState]) -> MaskBatch:
        return MaskBatch(self._pool, self._executor, states, self.stats)

    def now(self, state: GrammarState) -> None:
        """``state``'s mask, computed on this thread (a verified draft position: the mask after the accepted
        tokens; the step's batch is done by then)."""
        started = time.perf_counter()
        mask = allocate_token_bitmask(1, state.vocab_size)
        fill_next_token_bitmask(state.matcher, mask, 0)
        state.bitmask = mask[0]
        self.stats.seconds += time.perf_counter() - started
        self.stats.masks += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def check_json_schema(schema: object) -> None:
    """``GrammarRejected`` if the JSON Schema ``schema`` cannot become a grammar (no tokenizer needed)."""
    if not isinstance(schema, dict):
        raise GrammarRejected(f"the JSON Schema must be an object, got {type(schema).__name__}")
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarRejected(_first_lines(str(exc))) from None
    except RecursionError:
        raise GrammarRejected("the JSON Schema nests too deeply") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        raise GrammarRejected(_first_lines("; ".join(messages)))


def _llguidance_grammar(grammar: Grammar) -> str:
    if grammar.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(grammar.value)
    try:
        schema = json.loads(grammar.value)
    except ValueError as exc:
        raise GrammarRejected(f"the JSON Schema is not JSON: {exc}") from None
    except RecursionError:
        raise GrammarRejected("the JSON Schema nests too deeply") from None
    if not isinstance(schema, dict):
        raise GrammarRejected(f"the JSON Schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarRejected(str(exc)) from None


def _schema_patterns(grammar: Grammar) -> list[str]:
    """Every ``pattern`` string of a JSON Schema grammar (none for a regex)."""
    if grammar.kind != "json":
        return []
    found, stack = [], [json.loads(grammar.value)]  # it compiled: valid JSON
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return sorted(set(found))


def _rejection(grammar: Grammar, message: str) -> GrammarRejected:
    """The client's error for llguidance's ``message``: a limit in our words, else the compiler's first lines
    (a syntax error: "unclosed group")."""
    what = "the regex" if grammar.kind == "regex" else "the JSON Schema"
    for needles, words in _OVER_LIMIT:
        if any(needle in message for needle in needles):
            return GrammarRejected(f"{what} {words}")
    return GrammarRejected(_first_lines(message))


def _first_lines(message: str, limit: int = 600) -> str:
    message = message.replace("<non-verbose/>", "").strip()
    return message if len(message) <= limit else message[:limit] + "…"
