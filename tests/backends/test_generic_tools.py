"""The generic tool-call format without a model: our system message, the history in its convention, the
answer's JSON Schema (checked with jsonschema, independently of the grammar engine), the incremental parser
(split at every position: the pieces' events fold to the whole's), and the grammar on a real tokenizer (the
tiny chat model's): random walks always end in answers whose calls name a tool and follow its schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from backends.chat_format import THINK, ChatFormat, ToolCallSyntax
from backends.chat_output import ChatOutputParser, ParsedCall, fold
from backends.generic_output import GenericOutputParser, output_parser
from backends.generic_tools import generic_messages, output_schema, system_prompt
from backends.grammar import GrammarCompiler
from backends.mindspore.modeldir.tokenizer import Tokenizer
from backends.tool_grammar import tool_call_constraint
from tests.support.grammar_walk import grammar_walk
from tests.support.tiny_chat_model import make_tiny_chat_model

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 8}}, "required": ["text"],
        "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("note", NOTE)]
FUNCTIONS = [{"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
             {"name": "note", "parameters": NOTE}]
GENERIC = ChatFormat(ToolCallSyntax.GENERIC)
EOS = 2


# --- the system message -----------------------------------------------------------------------------------

@pytest.mark.parametrize("choice, parallel, says, not_says", [
    ("auto", True, ['{"response":"<your answer>"}', "several to call several tools"], ["exactly one"]),
    ("auto", False, ['{"response":', "(exactly one call)"], ["several"]),
    ("required", True, ["that calls tools", "several"], ['{"response"']),
    ("get_weather", False, ['calls the tool "get_weather"', '{"tool_calls":[{"name":"get_weather"'], ['{"response"']),
])
def test_the_system_message_lists_the_tools_and_the_answers_shape(choice, parallel, says, not_says):
    text = system_prompt(FUNCTIONS, choice, parallel)
    lines = text.splitlines()
    described = [json.loads(line) for line in lines if line.startswith('{"name"')]
    assert described == [{"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
                         {"name": "note", "description": "", "parameters": NOTE}]
    assert all(s in text for s in says) and not any(s in text for s in not_says), text
    assert '"tool_results"' in text


# --- the history ------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "weather in Oslo and Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "tool", "tool_call_id": "c2", "content": "sun"},
]


def test_the_history_is_written_in_the_generic_convention():
    out = generic_messages(CONVERSATION, "SYSTEM")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == "SYSTEM"
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                                            {"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert json.loads(out[3]["content"]) == {"tool_results": [
        {"tool_call_id": "c1", "name": "get_weather", "content": "rain"},
        {"tool_call_id": "c2", "name": "get_weather", "content": "sun"}]}
    assert CONVERSATION[1]["content"] == "" and "tool_calls" in CONVERSATION[1]  # the request's messages untouched


def test_our_system_message_joins_the_requests_and_none_adds_nothing():
    merged = generic_messages([{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]], "SYSTEM")
    assert merged == [{"role": "system", "content": "Be brief.\n\nSYSTEM"}, CONVERSATION[0]]
    assert generic_messages(CONVERSATION[:1], None) == CONVERSATION[:1]
    text = json.loads(generic_messages([{"role": "assistant", "content": "Let me look.",
                                         "tool_calls": CONVERSATION[1]["tool_calls"][:1]}], None)[0]["content"])
    assert text == {"response": "Let me look.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}


# --- the answer's schema (jsonschema, not the grammar engine) ---------------------------------------------

@pytest.mark.parametrize("answer, parallel, optional, valid", [
    ({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}, False, False, True),
    ({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}, True, True, False),
    ({"tool_calls": [{"name": "delete_all", "arguments": {}}]}, True, True, False),
    ({"tool_calls": [{"name": "note", "arguments": {"text": "a"}}] * 2}, True, False, True),
    ({"tool_calls": [{"name": "note", "arguments": {"text": "a"}}] * 2}, False, False, False),
    ({"tool_calls": []}, True, True, False),
    ({"response": "hello"}, True, True, True),
    ({"response": "hello"}, True, False, False),
    ({"response": "hello", "tool_calls": []}, True, True, False),
])
def test_the_answers_schema(answer, parallel, optional, valid):
    schema = output_schema(TOOLS, parallel=parallel, optional=optional)
    assert jsonschema.Draft202012Validator(schema).is_valid(answer) == valid


# --- the parser -------------------------------------------------------------------------------------------

CALLS = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo","days":3}},' \
        '{"name":"note","arguments":{"text":"a}\\"]b"}}]}'
RESPONSE = '{"response":"Line one\\nsaid \\"hi\\" \\u00e9 \\ud83d\\ude00 \\\\ end "}'


def parse_split(text: str, at: list[int], **kwargs):
    parser = output_parser(GENERIC, tools=True, **kwargs)
    cuts = [0, *at, len(text)]
    events = [e for a, b in zip(cuts, cuts[1:]) for e in parser.feed(text[a:b])]
    return fold([*events, *parser.finish()], reasoned=parser.reasoned)


@pytest.mark.parametrize("text, content, calls", [
    (CALLS, "", (ParsedCall("get_weather", '{"city":"Oslo","days":3}'), ParsedCall("note", '{"text":"a}\\"]b"}'))),
    (RESPONSE, 'Line one\nsaid "hi" é 😀 \\ end ', ()),
    ('{"response":""}', "", ()),
    ("not json at all", "not json at all", ()),
])
def test_every_split_parses_as_the_whole(text, content, calls):
    whole = parse_split(text, [])
    assert (whole.content, whole.calls) == (content, calls)
    if text.startswith("{"):
        assert json.loads(text).get("response", content) == content  # an independent reading of the text
    for i in range(1, len(text)):
        assert parse_split(text, [i]) == whole, i
    assert parse_split(text, list(range(1, len(text)))) == whole


def test_parallel_false_keeps_one_call_and_a_cut_call_keeps_what_was_streamed():
    assert parse_split(CALLS, [], max_calls=1).calls == (ParsedCall("get_weather", '{"city":"Oslo","days":3}'),)
    cut = parse_split(CALLS[:CALLS.index("Oslo") + 2], [20])
    assert cut.calls == (ParsedCall("get_weather", '{"city":"Os'),) and cut.content == ""
    assert parse_split('{"respo', []).content == '{"respo'  # cut before the shape showed: the text as written


def test_a_reasoning_block_comes_first_and_the_parser_is_chosen_by_format():
    fmt = ChatFormat(ToolCallSyntax.GENERIC, THINK)
    text = "<think>need weather</think>" + CALLS
    parser = output_parser(fmt, tools=True)
    out = fold([*parser.feed(text), *parser.finish()], reasoned=parser.reasoned)
    assert out.reasoning == "need weather" and len(out.calls) == 2 and parser.reasoning_end == text.index("{")
    assert isinstance(parser, GenericOutputParser)
    assert isinstance(output_parser(GENERIC, tools=False), ChatOutputParser)  # tool_choice none: plain text
    assert isinstance(output_parser(ChatFormat(ToolCallSyntax.HERMES), tools=True), ChatOutputParser)


# --- the grammar on a real tokenizer ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tokenizer = Tokenizer.from_model_dir(make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")))
    return tokenizer, GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, [EOS])


def walk(model, grammar, seed: int) -> str:
    """Random allowed tokens (closing punctuation and EOS favoured, so strings end) until the grammar ends."""
    tokenizer, compiler = model
    favoured = [EOS, *(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]).strip() in '"}],')]
    return grammar_walk(tokenizer, compiler, grammar, seed, eos=EOS, favoured=favoured, weight=30.0, steps=600,
                        must_end=True)


@pytest.mark.parametrize("tools, parallel, optional", [
    (TOOLS, True, False), (TOOLS, False, False), (TOOLS[:1], False, False), (TOOLS, True, True),
])
def test_every_walk_is_an_answer_whose_calls_follow_their_schemas(model, tools, parallel, optional):
    grammar = tool_call_constraint(tools, GENERIC, parallel=parallel, optional=optional)
    schemas, responses = dict(tools), 0
    for seed in range(16):
        text = walk(model, grammar, seed)
        answer = json.loads(text)  # the whole output is one JSON object
        jsonschema.validate(answer, output_schema(tools, parallel=parallel, optional=optional))
        parsed = parse_split(text, [len(text) // 2], max_calls=None if parallel else 1)
        if "response" in answer:
            responses += 1
            assert parsed.content == answer["response"] and not parsed.calls
            continue
        assert [c.name for c in parsed.calls] == [c["name"] for c in answer["tool_calls"]]
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert optional or responses == 0


@pytest.mark.parametrize("prefix", [
    '{"tool_calls":[{"name":"delete_all"',  # a tool not in the list
    '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Rome"',  # arguments off the schema
    '{"response":"hi"}',  # required: no text answer
    "Sure! ",  # no text outside the JSON
])
def test_what_the_grammar_refuses(model, prefix):
    tokenizer, compiler = model
    state = compiler.compile(tool_call_constraint(TOOLS, GENERIC, parallel=True, optional=False))
    ids = tokenizer.encode(prefix)
    assert state.valid_prefix(ids) < len(ids)


def test_a_reasoning_block_may_come_before_the_answer(model):
    grammar = tool_call_constraint(TOOLS, ChatFormat(ToolCallSyntax.GENERIC, THINK), parallel=False, thinking=True)
    tokenizer, compiler = model
    ids = tokenizer.encode('plan</think>{"tool_calls":[{"name":"note","arguments":{"text":"x"}}]}')
    assert compiler.compile(grammar).valid_prefix(ids) == len(ids)
