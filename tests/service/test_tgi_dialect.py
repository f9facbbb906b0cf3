"""Table tests for service/dialects/tgi.py (body → ParsedRequest, results → JSON) and service/errors.py."""
from __future__ import annotations

from typing import Any

import pytest

from backends import errors as backend_errors
from backends.types import (
    FinishReason,
    GenerationResult,
    Grammar,
    RequestParams,
    Token,
    TokenEvent,
)
from service import errors
from service.context import RequestLimits
from service.dialects.tgi import (
    InputPart,
    ParsedRequest,
    StreamRenderer,
    parse_generate_request,
    render_response,
    render_stream_event,
)
from service.errors import ValidationError, error_body
from service.validation import Schemas

PROMPT = "My name is Olivier and I"
IMAGE = {"type": "image_url", "image_url": "/data/multimodal_inputs/cat.png"}


@pytest.fixture(scope="module")
def schemas() -> Schemas:
    return Schemas()


def _parse(parameters: dict[str, Any] | None = None, **body: Any) -> ParsedRequest:
    return parse_generate_request({"inputs": PROMPT, "parameters": parameters, **body})


# --- parse ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("parameters, expected", [
    (None, RequestParams()),
    ({}, RequestParams()),
    ({"max_new_tokens": None, "stop": None, "seed": None, "watermark": None}, RequestParams()),
    ({"max_new_tokens": 5.0}, RequestParams(max_new_tokens=5)),
    ({"stop": "###"}, RequestParams(stop=("###",))),
    ({"stop": []}, RequestParams(stop=())),
    ({"stop": ["a", "b"]}, RequestParams(stop=("a", "b"))),
    ({"adapter_id": "None"}, RequestParams(adapter_id=None)),
    ({"adapter_id": "sql/v1"}, RequestParams(adapter_id="sql/v1")),
    ({"do_sample": False}, RequestParams(do_sample=False)),
    ({"temperature": 1, "top_k": 10, "top_p": 0.95, "typical_p": 0.5, "repetition_penalty": 1.03},
     RequestParams(temperature=1.0, top_k=10, top_p=0.95, typical_p=0.5, repetition_penalty=1.03)),
    ({"seed": 18446744073709551615, "truncate": 7}, RequestParams(seed=18446744073709551615, truncate=7)),
    ({"watermark": True, "return_full_text": True, "decoder_input_details": True},
     RequestParams(watermark=True, decoder_input_details=True)),
    ({"best_of": 1, "top_n_tokens": 0, "frequency_penalty": 0.0, "grammar": None}, RequestParams()),
    ({"speculate": False}, RequestParams(speculate=False)),
    ({"speculate": None}, RequestParams()),
])
def test_parameters_become_request_params(parameters: dict[str, Any] | None, expected: RequestParams) -> None:
    assert _parse(parameters).params == expected


def test_return_full_text_is_kept_for_rendering() -> None:
    assert _parse({"return_full_text": True}).return_full_text and not _parse({}).return_full_text


def test_types_are_exact() -> None:
    params = _parse({"temperature": 1, "max_new_tokens": 5.0}).params
    assert type(params.temperature) is float and type(params.max_new_tokens) is int


@pytest.mark.parametrize("body, stream, details, want_details", [
    ({}, False, False, False),
    ({"stream": None}, False, False, False),
    ({"stream": True, "parameters": {"details": True}}, True, True, True),
    ({"parameters": {"details": None, "decoder_input_details": True}}, False, False, True),
])
def test_stream_and_details_flags(body: dict[str, Any], stream: bool, details: bool, want_details: bool) -> None:
    req = parse_generate_request({"inputs": PROMPT, **body})
    assert (req.stream, req.details, req.want_details) == (stream, details, want_details)


@pytest.mark.parametrize("parameters, fragments", [
    ({"stop": ["x" * 1024] * 32 + ["y"]}, ["parameters.stop", "32768", "32769"]),
])
def test_cross_field_rules_name_field_and_value(parameters: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ValidationError) as caught:
        _parse(parameters)
    assert all(f in str(caught.value) for f in fragments), str(caught.value)


@pytest.mark.parametrize("parameters, fragments", [
    ({"best_of": 2}, ["parameters.best_of", "2"]),
    ({"best_of": True}, ["parameters.best_of", "true"]),
    ({"top_n_tokens": 5}, ["parameters.top_n_tokens", "5"]),
    ({"top_n_tokens": False}, ["parameters.top_n_tokens", "false"]),
    ({"frequency_penalty": 0.5}, ["parameters.frequency_penalty", "0.5"]),
])
def test_client_keys_take_only_their_neutral_values_by_the_schema(schemas, parameters: dict[str, Any],
                                                                  fragments: list[str]) -> None:
    """The HuggingFace client's keys (best_of, top_n_tokens, frequency_penalty): the schema's enums are their
    one rule, checked before the dialect parses."""
    with pytest.raises(ValidationError) as caught:
        schemas.validate("generate_request", {"inputs": PROMPT, "parameters": parameters})
    assert all(f in str(caught.value) for f in fragments), str(caught.value)
    neutral = {key: 1 if key == "best_of" else 0.0 for key in parameters}
    schemas.validate("generate_request", {"inputs": PROMPT, "parameters": neutral})


def test_stop_total_at_limit_is_accepted() -> None:
    assert len(_parse({"stop": ["x" * 1024] * 32}).params.stop) == 32


def test_decoder_input_details_with_stream_is_rejected_by_the_schema(schemas) -> None:
    body = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}, "stream": True}
    with pytest.raises(ValidationError, match=r"parameters\.decoder_input_details is not allowed: a stream"):
        schemas.validate("generate_request", body)
    schemas.validate("generate_request", {**body, "stream": False})
    schemas.validate("generate_request", {**body, "parameters": {"decoder_input_details": False}})
    assert _parse({"decoder_input_details": False}, stream=True).stream


@pytest.mark.parametrize("inputs, media_types, error", [
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], frozenset(), None),
    ([{"type": "text", "text": "a"}, IMAGE], frozenset(), 'inputs[1] has type "image_url"'),
    ([{"type": "video_url", "video_url": "/data/multimodal_inputs/v.mp4"}], frozenset({"image_url"}),
     'inputs[0] has type "video_url"'),
    ([{"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}}], frozenset(), 'type "audio_url"'),
    ([{"type": "text", "text": "a"}, IMAGE], frozenset({"image_url"}), None),
])
def test_multimodal_parts(inputs: list[dict[str, Any]], media_types: frozenset[str], error: str | None) -> None:
    limits = RequestLimits(media_types=media_types)
    if error is None:
        req = parse_generate_request({"inputs": inputs}, limits=limits)
        assert all(isinstance(part, InputPart) for part in req.inputs)
        return
    with pytest.raises(ValidationError) as caught:
        parse_generate_request({"inputs": inputs}, limits=limits)
    assert error in str(caught.value)


def test_parts_keep_values_and_prompt_text() -> None:
    body = {"inputs": [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": "u"}},
                       {"type": "text", "text": "this"}]}
    req = parse_generate_request(body, limits=RequestLimits(media_types=frozenset({"image_url"})))
    assert req.inputs == (InputPart("text", "Describe "), InputPart("image_url", "u"), InputPart("text", "this"))
    assert req.prompt_text == "Describe this"


@pytest.mark.parametrize("adapter_id, loaded, ok", [
    ("None", frozenset(), True),
    ("sql/v1", None, True),
    ("sql/v1", frozenset({"sql/v1"}), True),
    ("chat", frozenset({"sql/v1"}), False),
])
def test_adapter_must_be_loaded(adapter_id: str, loaded: frozenset[str] | None, ok: bool) -> None:
    body = {"inputs": PROMPT, "parameters": {"adapter_id": adapter_id}}
    if ok:
        parse_generate_request(body, limits=RequestLimits(adapter_ids=loaded))
        return
    expected = r'parameters\.adapter_id "chat" is not a loaded adapter \(loaded: sql/v1\)'
    with pytest.raises(ValidationError, match=expected):
        parse_generate_request(body, limits=RequestLimits(adapter_ids=loaded))


# --- token limits ----------------------------------------------------------------------------------

# --- render: non-stream ------------------------------------------------------------------------------

PREFILL = (Token(5050, "My", None, False), Token(829, " name", -2.5, False))
TOKENS = (Token(2776, "'m", -0.53, False), Token(264, " a", -0.1, False))
RESULT = GenerationResult(generated_text="'m a", finish_reason=FinishReason.LENGTH, prompt_tokens=2,
                          generated_tokens=2, seed=789070824, tokens=TOKENS, prefill=PREFILL)


@pytest.mark.parametrize("parameters, has_details, has_prefill", [
    ({}, False, False),
    ({"details": True}, True, False),
    ({"decoder_input_details": True}, True, True),
    ({"details": True, "decoder_input_details": True}, True, True),
    ({"details": False, "decoder_input_details": False}, False, False),
])
def test_render_response_details(schemas: Schemas, parameters: dict[str, Any], has_details: bool,
                                 has_prefill: bool) -> None:
    body = render_response(RESULT, _parse(parameters))
    schemas.validate("response", body)
    assert len(body) == 1 and body[0]["generated_text"] == "'m a"
    assert ("details" in body[0]) is has_details
    if has_details:
        details = body[0]["details"]
        assert list(details) == ["prompt_tokens", "finish_reason", "generated_tokens", "prefill", "seed", "tokens"]
        assert details["finish_reason"] == "length" and details["seed"] == 789070824
        assert details["tokens"][0] == {"id": 2776, "logprob": -0.53, "special": False, "text": "'m"}
        assert len(details["prefill"]) == (2 if has_prefill else 0)


@pytest.mark.parametrize("inputs, return_full_text, expected", [
    (PROMPT, False, "'m a"),
    (PROMPT, True, PROMPT + "'m a"),
    (PROMPT, None, "'m a"),
    ([{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], True, "AB'm a"),
])
def test_render_response_return_full_text(inputs: Any, return_full_text: bool | None, expected: str) -> None:
    req = parse_generate_request({"inputs": inputs, "parameters": {"return_full_text": return_full_text}})
    assert render_response(RESULT, req)[0]["generated_text"] == expected


# --- render: stream ------------------------------------------------------------------------------

EVENT = TokenEvent(token=Token(263, " a", -0.2, False), index=1, text=" a")


@pytest.mark.parametrize("token_id_format, expected_id", [("list", [263]), ("int", 263)])
def test_stream_token_id_format(schemas: Schemas, token_id_format: str, expected_id: Any) -> None:
    out = render_stream_event(EVENT, token_id_format=token_id_format)  # type: ignore[arg-type]
    schemas.validate("stream_event", out)
    assert out == {"token": {"id": expected_id, "text": " a", "logprob": -0.2, "special": False},
                   "generated_text": None, "details": None}


@pytest.mark.parametrize("want_details, details", [
    (False, None),
    (True, {"prompt_tokens": 2, "finish_reason": "length", "generated_tokens": 2, "seed": 789070824}),
])
def test_stream_final_event(schemas: Schemas, want_details: bool, details: dict[str, Any] | None) -> None:
    out = render_stream_event(EVENT, final_result=RESULT, want_details=want_details, text_prefix="P: ")
    schemas.validate("stream_event", out)
    assert out["generated_text"] == "P: 'm a" and out["details"] == details
    assert out["token"]["text"] == " a"


@pytest.mark.parametrize("full_text_enabled, texts", [(False, ["'m", " a"]), (True, ["'m", "'m a"])])
def test_stream_renderer_full_text(full_text_enabled: bool, texts: list[str]) -> None:
    renderer = StreamRenderer(_parse({"details": True}, stream=True), full_text_enabled=full_text_enabled)
    first = renderer.event(TokenEvent(TOKENS[0], 0, TOKENS[0].text))
    last = renderer.event(TokenEvent(TOKENS[1], 1, TOKENS[1].text), final_result=RESULT)
    assert [first["token"]["text"], last["token"]["text"]] == texts
    assert first["generated_text"] is None and first["details"] is None
    assert last["generated_text"] == "'m a" and last["details"]["finish_reason"] == "length"


def test_stream_renderer_return_full_text_and_no_details() -> None:
    renderer = StreamRenderer(_parse({"return_full_text": True}, stream=True), token_id_format="int")
    last = renderer.event(TokenEvent(TOKENS[0], 0, TOKENS[0].text), final_result=RESULT)
    assert last["generated_text"] == PROMPT + "'m a" and last["details"] is None and last["token"]["id"] == 2776


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc, status, error_type", [
    (errors.BadRequest("x"), 400, "Bad Request"),
    (errors.NotFound("x"), 404, "NotFoundError"),
    (errors.MethodNotAllowed("x"), 405, "Method Not Allowed"),
    (errors.PayloadTooLarge("x"), 413, "Payload Too Large"),
    (errors.ValidationError("x"), 422, "Input Validation Error"),
    (errors.FailedDependency("x"), 424, "Generation Error"),
    (errors.TooManyRequests("x"), 429, "Too Many Requests"),
    (errors.IncompleteGeneration("x"), 500, "Incomplete Generation"),
    (errors.ServiceUnavailable("x"), 503, "Service Unavailable"),
])
def test_error_taxonomy(schemas: Schemas, exc: errors.ServiceError, status: int, error_type: str) -> None:
    assert exc.status == status
    assert error_body(exc) == {"error": "x", "error_type": error_type}
    assert type(errors.for_status(status, "x")) is type(exc)
    schemas.validate("error", error_body(exc))


@pytest.mark.parametrize("exc, status, message", [
    (backend_errors.InputRejected("inputs has 9000 tokens"), 422, "inputs has 9000 tokens"),
    (backend_errors.EngineOverloaded("queue full"), 429, "queue full"),
    (backend_errors.EngineUnavailable("loading"), 503, "loading"),
    (backend_errors.GenerationFailed("NaN logits"), 424, "NaN logits"),
    (backend_errors.BackendError("odd"), 500, "odd"),
    (KeyError("secret"), 500, errors.INTERNAL_ERROR_MESSAGE),
])
def test_backend_errors_map_to_statuses(exc: Exception, status: int, message: str) -> None:
    mapped = errors.from_backend_error(exc)
    assert (mapped.status, mapped.message) == (status, message)
    assert error_body(exc)["error"] == message


def test_unknown_status_is_500() -> None:
    assert errors.for_status(418, "teapot").status == 500


@pytest.mark.parametrize("grammar, expected", [
    ({"type": "regex", "value": "a+"}, Grammar("regex", "a+")),
    ({"type": "json", "value": {"type": "object", "required": ["a"]}},
     Grammar("json", '{"type":"object","required":["a"]}')),
    ({"type": "json", "value": '{"type": "integer"}'}, Grammar("json", '{"type": "integer"}')),
    (None, None),
])
def test_grammar_becomes_the_engines_grammar(grammar: Any, expected: Any) -> None:
    assert _parse({"grammar": grammar}).params.grammar == expected


def test_grammar_that_does_not_compile_is_a_422_naming_the_field() -> None:
    from backends.grammar import GrammarRejected
    from service.dialects.tgi import TGIDialect

    err = TGIDialect().submit_error(GrammarRejected("regex parse error: unclosed group"), _parse({}))
    assert err.status == 422
    assert "parameters.grammar" in err.message and "unclosed group" in err.message
