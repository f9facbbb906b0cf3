"""The OpenAI dialect's parse of the structured-output and sampling-control fields (response_format,
logit_bias, ignore_eos, min_tokens) and how an engine refusal of one of them is reported."""
from __future__ import annotations

from typing import Any

import pytest

from backends.errors import ParameterRejected
from backends.grammar import ANY_JSON_OBJECT
from backends.types import Grammar
from service.dialects.openai import CHAT, COMPLETIONS, InvalidRequest, parse_openai_request
from service.validation import default_schemas

SCHEMAS = default_schemas()
MODEL = "m"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any):
    return parse_openai_request("chat", {"model": MODEL, "messages": MESSAGES, **fields}, SCHEMAS, MODEL)


def completion(**fields: Any):
    return parse_openai_request("completion", {"model": MODEL, "prompt": "hi", **fields}, SCHEMAS, MODEL)


@pytest.mark.parametrize("response_format, grammar", [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, Grammar("json", ANY_JSON_OBJECT)),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}, "strict": True}},
     Grammar("json", '{"type":"integer"}')),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, Grammar("json", "{}")),
])
def test_response_format_becomes_the_grammar(response_format, grammar):
    assert chat(response_format=response_format).params.grammar == grammar
    assert completion(response_format=response_format).params.grammar == grammar


def test_sampling_controls():
    params = chat(logit_bias={"15": -100, "7": 100.0}, ignore_eos=True, min_tokens=3).params
    assert params.logit_bias == ((15, -100.0), (7, 100.0))
    assert params.ignore_eos and params.min_tokens == 3
    assert completion().params.logit_bias == () and not completion().params.ignore_eos


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"15": 101}}, "logit_bias.15"),
    ({"logit_bias": {"15": -100.5}}, "logit_bias.15"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        chat(**fields)
    assert caught.value.status == 422  # sent as 400 by openai_error
    assert caught.value.param == param, caught.value.message


@pytest.mark.parametrize("dialect", [CHAT, COMPLETIONS])
def test_engine_refusals_name_the_openai_field(dialect):
    grammar = dialect.submit_error(ParameterRejected("grammar", "regex parse error: unclosed group"), None)
    assert grammar.param == "response_format" and "unclosed group" in grammar.message
    bias = dialect.submit_error(ParameterRejected("logit_bias", "token id 99999 outside"), None)
    assert bias.param == "logit_bias" and "99999" in bias.message
