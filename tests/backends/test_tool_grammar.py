"""The tool-call grammar on a real tokenizer (the tiny Qwen3-like model's): random walks through the tokens
it allows always end in outputs whose calls parse and follow their tool's schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from backends.chat_format import chat_format
from backends.chat_output import parse_chat_output
from backends.grammar import GrammarCompiler
from backends.mindspore.modeldir.tokenizer import Tokenizer
from backends.tool_grammar import tool_call_constraint
from tests.support.grammar_walk import grammar_walk
from tests.support.tiny_chat_model import make_tiny_chat_model, marker_ids

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
NOOP = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("noop", NOOP)]
EOS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    tokenizer = Tokenizer.from_model_dir(directory)
    return tokenizer, GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, [EOS]), marker_ids(directory)


def walk(model, grammar, seed: int) -> str:
    """Random allowed tokens (the markers and EOS favoured) until the grammar ends or allows EOS and it is drawn."""
    tokenizer, compiler, markers = model
    return grammar_walk(tokenizer, compiler, grammar, seed, eos=EOS, favoured=[*markers.values(), EOS], weight=40.0,
                        steps=400)


@pytest.mark.parametrize("tools, parallel, optional", [
    (TOOLS, True, False), (TOOLS[:1], False, False), (TOOLS, True, True),
])
def test_every_walk_is_calls_that_follow_their_schemas(model, tools, parallel, optional):
    fmt = chat_format(model[0].chat_template)
    grammar = tool_call_constraint(tools, fmt, parallel=parallel, optional=optional)
    schemas = dict(tools)
    for seed in range(12):
        text = walk(model, grammar, seed)
        output = parse_chat_output(text, fmt, tools=True)
        if not optional:
            assert output.calls and (parallel or len(output.calls) == 1), text
        assert "<tool_call>" not in output.content, text  # every started call was completed and parsed
        for call in output.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_prompt_that_opened_the_block_must_close_it_first(model):
    fmt = chat_format(model[0].chat_template)
    grammar = tool_call_constraint(TOOLS, fmt, parallel=False, thinking=True)
    for seed in range(6):
        text = walk(model, grammar, seed)
        assert "</think>" in text and not text.startswith("<think>")
        assert len(parse_chat_output(text, fmt, thinking=True, tools=True).calls) == 1
