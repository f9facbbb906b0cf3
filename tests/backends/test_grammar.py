"""Constrained decoding (backends/grammar.py) on a tiny trained BPE tokenizer: the masks agree with an
independent enumeration, random walks inside the masks give text the regex / JSON Schema accept, and bad
or oversized grammars are refused with the compiler's message."""
import json
import re

import jsonschema
import numpy as np
import pytest

from backends.grammar import MAX_GRAMMAR_BYTES, GrammarCompiler, GrammarRejected, MaskWorker
from backends.types import Grammar
from tests.support.tiny_checkpoint import EOS, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(384)


@pytest.fixture(scope="module")
def eos(tok):
    return tok.token_to_id(EOS)


@pytest.fixture(scope="module")
def compiler(tok, eos):
    return GrammarCompiler(tok.to_str(), tok.get_vocab_size(), [eos])


@pytest.fixture(scope="module")
def worker():
    w = MaskWorker()
    yield w
    w.close()


def mask_of(worker, state) -> np.ndarray:
    worker.start([state]).wait()
    return state.allowed()


def walk(compiler, worker, tok, eos, grammar, seed, limit=200) -> str:
    """Choose uniformly among the allowed tokens until the grammar allows only EOS (or EOS is drawn)."""
    rng = np.random.default_rng(seed)
    state = compiler.compile(grammar)
    ids = []
    for _ in range(limit):
        allowed = np.flatnonzero(mask_of(worker, state))
        assert allowed.size, "the grammar allows nothing"
        non_eos = allowed[allowed != eos]
        pick = int(rng.choice(allowed if rng.random() < 0.3 or not non_eos.size else non_eos))
        state.advance(pick)
        if pick == eos:
            return tok.decode(ids)
        ids.append(pick)
    raise AssertionError(f"no end after {limit} tokens: {tok.decode(ids)!r}")


def test_first_mask_is_exactly_the_prefix_tokens(compiler, worker, tok, eos):
    words = ("yes!", "no!")
    allowed = set(np.flatnonzero(mask_of(worker, compiler.compile(Grammar("regex", r"(yes|no)!")))).tolist())
    expected = {i for i in range(tok.get_vocab_size())
                if i != eos and (text := tok.decode([i])) and any(w.startswith(text) for w in words)}
    assert expected and allowed == expected


@pytest.mark.parametrize("pattern", [r"(yes|no)!", r"[0-9]{3}-[a-z]{2,4}", r"(ab|cd)+x", r"-?[1-9][0-9]{0,5}"])
def test_regex_walks_fullmatch(compiler, worker, tok, eos, pattern):
    for seed in range(5):
        assert re.fullmatch(pattern, walk(compiler, worker, tok, eos, Grammar("regex", pattern), seed))


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"n": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                            "required": ["ok"], "additionalProperties": False},
                                      "s": {"type": "string", "pattern": "^[a-c]{1,4}$"}},
     "required": ["n", "s"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_walks_validate(compiler, worker, tok, eos, schema):
    for seed in range(5):
        text = walk(compiler, worker, tok, eos, Grammar("json", json.dumps(schema)), seed)
        jsonschema.validate(json.loads(text), schema)


def test_eos_allowed_only_at_the_end(compiler, worker, eos, tok):
    state = compiler.compile(Grammar("regex", "ab"))
    assert not mask_of(worker, state)[eos]
    for i in tok.encode("ab", add_special_tokens=False).ids:
        state.advance(i)
    allowed = mask_of(worker, state)
    assert allowed[eos] and allowed.sum() == 1


@pytest.mark.parametrize("grammar, message", [
    (Grammar("json", '{"type": "objectx"}'), "objectx"),
    (Grammar("json", '{"type": "string", "pattern": "(("}'), "unclosed group"),
    (Grammar("json", "[1, 2]"), "must be an object"),
    (Grammar("json", "{not json"), "not JSON"),
    (Grammar("regex", "a(b"), "unclosed group"),
    (Grammar("json", json.dumps({"enum": [f"value-{i}" for i in range(100_000)]})), "more than the limit"),
    (Grammar("regex", "a" * (MAX_GRAMMAR_BYTES + 1)), "more than the limit"),
])
def test_bad_grammars_are_refused_with_the_compilers_message(compiler, grammar, message):
    with pytest.raises(GrammarRejected, match=re.escape(message)):
        compiler.compile(grammar)


def test_deep_schema_is_refused(compiler):
    levels = 1000  # 2000 objects deep, in 54 kB
    deep = '{"type":"object","required":["a"],"properties":{"a":' * levels + '{"type":"integer"}' + "}}" * levels
    with pytest.raises(GrammarRejected, match="recursion|nest"):
        compiler.compile(Grammar("json", deep))


def test_mask_cost_is_counted(compiler, worker):
    before = worker.stats.masks
    mask_of(worker, compiler.compile(Grammar("regex", "x+")))
    assert worker.stats.masks == before + 1 and worker.stats.seconds > 0


def _nested(levels: int, wrap) -> str:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = wrap(schema)
    return json.dumps(schema)


OVER_LIMITS = [
    (Grammar("regex", "a{1000000}"), "the regex is too complex for the grammar engine"),
    (Grammar("json", _nested(200, lambda s: {"type": "array", "items": s})), "the JSON Schema nests too deeply"),
    (Grammar("json", _nested(150, lambda s: {"type": "object", "properties": {"a": s}, "required": ["a"]})),
     "the JSON Schema nests too deeply"),
]


@pytest.mark.parametrize("grammar, words", OVER_LIMITS, ids=["a{1000000}", "arrays-200-deep", "objects-150-deep"])
def test_check_refuses_a_grammar_over_the_engines_limits_in_our_words(compiler, grammar, words):
    with pytest.raises(GrammarRejected) as info:
        compiler.check(grammar)
    message = str(info.value)
    assert message.startswith(words), message
    for internal in ("<state>", "Tokens:", "lexer_cost", "<grammar>", "non-verbose", "Parser:"):
        assert internal not in message


@pytest.mark.parametrize("grammar", [
    Grammar("regex", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    Grammar("regex", "a{1000}"),
    Grammar("regex", "((a+)+(b+)+c)" * 300),
    Grammar("json", _nested(20, lambda s: {"type": "object", "properties": {"a": s}, "required": ["a"]})),
    Grammar("json", '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},'
                    ' "required": ["name", "age"]}'),
], ids=["ipv4", "a{1000}", "catastrophic-backtracking", "objects-20-deep", "person"])
def test_check_passes_a_grammar_the_engine_can_run(compiler, worker, tok, eos, grammar):
    compiler.check(grammar)
    if "25[0-5]" in grammar.value:  # and it generates what it says
        text = walk(compiler, worker, tok, eos, grammar, seed=1)
        assert re.fullmatch(grammar.value, text), text


def test_check_keeps_the_compilers_words_for_a_syntax_error(compiler):
    with pytest.raises(GrammarRejected, match="unclosed group") as info:
        compiler.check(Grammar("regex", "a(b"))
    assert "non-verbose" not in str(info.value)


def test_a_grammar_failing_in_generation_never_carries_the_lexer_state(compiler, worker, tok):
    """What the 424 used to show: the engine's own matcher fails at the first token, without its state."""
    state = compiler.compile(Grammar("regex", "a{1000000}"))
    mask_of(worker, state)
    with pytest.raises(RuntimeError) as info:
        state.advance(tok.token_to_id("a"))
    assert "<state>" not in str(info.value) and "Tokens:" not in str(info.value)
