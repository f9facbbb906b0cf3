"""The OpenAI dialect's parse of the structured-output and sampling-control fields (response_format,
logit_bias, ignore_eos, min_tokens) and how an engine refusal of one of them is reported."""
from __future__ import annotations

import dataclasses
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
    assert not chat(speculate=False).params.speculate and not completion(speculate=False).params.speculate
    assert chat().params.speculate and completion(speculate=None).params.speculate


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"15": 101}}, "logit_bias.15"),
    ({"logit_bias": {"15": -100.5}}, "logit_bias.15"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"speculate": "no"}, "speculate"),
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


# --- logprobs --------------------------------------------------------------------------------------------

from backends.types import FinishReason, GenerationResult, Token  # noqa: E402
from service.dialects.openai import ChunkRenderer, OpenAIStream, render_completion, usage  # noqa: E402


def _result() -> GenerationResult:
    alt = (Token(5, "Hi", -0.1, False), Token(6, "Yo", -2.5, False))
    tokens = (Token(5, "Hi", -0.1, False, alt), Token(7, "!", -0.3, False, (Token(7, "!", -0.3, False),)),
              Token(2, "<|im_end|>", -0.01, True, ()))
    return GenerationResult("Hi!", FinishReason.EOS_TOKEN, 3, 3, 1, tokens)


@pytest.mark.parametrize("fields, logprobs, top", [
    ({}, False, 0), ({"logprobs": True}, True, 0), ({"logprobs": True, "top_logprobs": 2}, True, 2),
    ({"logprobs": False}, False, 0),
])
def test_chat_logprobs_fields(fields, logprobs, top):
    req = chat(**fields)
    assert (req.logprobs, req.params.top_logprobs) == (logprobs, top)


def test_completion_logprobs_is_the_count():
    assert (completion(logprobs=3).logprobs, completion(logprobs=3).params.top_logprobs) == (True, 3)
    assert (completion(logprobs=0).logprobs, completion().logprobs) == (True, False)


@pytest.mark.parametrize("fields, param", [({"top_logprobs": 2}, "top_logprobs"),
                                           ({"logprobs": True, "top_logprobs": 21},
                                                                                    "top_logprobs")])
def test_bad_logprobs_fields(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        chat(**fields)
    assert caught.value.param == param


def test_chat_logprobs_shape_and_schema():
    body = render_completion(chat(logprobs=True, top_logprobs=2), _result(), response_id="chatcmpl-x", model=MODEL)
    SCHEMAS.validate("openai_chat_response", body)
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hi", "!"]  # the final EOS is not reported
    assert content[0]["top_logprobs"] == [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
                                          {"token": "Yo", "logprob": -2.5, "bytes": [89, 111]}]


def test_completion_logprobs_shape_offsets_with_echo():
    req = completion(logprobs=1, echo=True)
    body = render_completion(req, _result(), response_id="cmpl-x", model=MODEL)
    SCHEMAS.validate("openai_completion_response", body)
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hi", "!"] and lp["token_logprobs"] == [-0.1, -0.3]
    assert lp["text_offset"] == [2, 4]  # after the echoed prompt "hi"
    assert lp["top_logprobs"] == [{"Hi": -0.1, "Yo": -2.5}, {"!": -0.3}]


def test_stream_sends_a_chunk_per_token_with_its_logprobs():
    import json as _json

    req = chat(logprobs=True, stream=True)
    stream = OpenAIStream(req, ChunkRenderer(req, response_id="chatcmpl-x", model=MODEL))
    result = _result()
    from backends.types import TokenEvent

    events = []
    for i, token in enumerate(result.tokens):
        events += stream.on_token(TokenEvent(token, i, "" if token.special else token.text, last=i == 2))
    chunks = [_json.loads(e.removeprefix("data: ")) for e in events]
    for chunk in chunks:
        SCHEMAS.validate("openai_chat_chunk", chunk)
    with_logprobs = [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks if c["choices"][0]["logprobs"]]
    assert with_logprobs == ["Hi", "!"]


@pytest.mark.parametrize("finish", [FinishReason.EOS_TOKEN, FinishReason.LENGTH])
def test_a_final_eos_has_no_logprob_in_body_and_stream_alike(finish):
    """An EOS exactly at the length cap finishes as "length": body and stream both leave it out."""
    import dataclasses
    import json as _json

    from backends.types import TokenEvent

    result = dataclasses.replace(_result(), finish_reason=finish)
    req = chat(logprobs=True)
    body = render_completion(req, result, response_id="chatcmpl-x", model=MODEL)
    in_body = [e["token"] for e in body["choices"][0]["logprobs"]["content"]]
    stream = OpenAIStream(req, ChunkRenderer(req, response_id="chatcmpl-x", model=MODEL))
    events = []
    for i, token in enumerate(result.tokens):
        events += stream.on_token(TokenEvent(token, i, "" if token.special else token.text,
                                             last=i == len(result.tokens) - 1))
    chunks = [_json.loads(e.removeprefix("data: ")) for e in events]
    in_stream = [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks if c["choices"][0]["logprobs"]]
    assert in_body == in_stream == ["Hi", "!"]


# --- n ---------------------------------------------------------------------------------------------------

from service.dialects import choice_params  # noqa: E402


def test_n_is_the_number_of_choices_and_not_with_stream():
    assert chat(n=3).choices == 3 and completion().choices == 1
    with pytest.raises(InvalidRequest) as caught:
        chat(n=2, stream=True)
    assert caught.value.param == "n"


@pytest.mark.parametrize("seed, index, expected", [(None, 2, None), (5, 0, 5), (5, 2, 7), (2**64 - 1, 1, 1)])
def test_choice_seeds(seed, index, expected):
    from backends.types import RequestParams

    assert choice_params(RequestParams(seed=seed), index).seed == expected


def test_n_choices_render_in_order_with_usage_summed():
    other = GenerationResult("Yo", FinishReason.LENGTH, 3, 5, 2, ())
    body = render_completion(chat(n=2), [_result(), other], response_id="chatcmpl-x", model=MODEL)
    SCHEMAS.validate("openai_chat_response", body)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hi!", "stop"), (1, "Yo", "length")]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(kind):
    """usage.prompt_tokens_details.cached_tokens: the body's (the prompt once: the first choice's), and the
    include_usage chunk's."""
    cached = dataclasses.replace(_result(), cached_tokens=2)
    other = GenerationResult("Yo", FinishReason.LENGTH, 3, 5, 2, (), cached_tokens=3)
    req = chat(n=2) if kind == "chat" else completion(n=2)
    body = render_completion(req, [cached, other], response_id="x", model=MODEL)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert usage(cached)["prompt_tokens_details"] == {"cached_tokens": 2}
