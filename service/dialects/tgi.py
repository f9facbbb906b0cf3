"""The TGI dialect: ``POST /`` (docs/api.md), TGI's ``POST /generate`` and ``POST /generate_stream``.

Request side: a body that passes ``generate_request.schema.json`` → ``ParsedRequest`` (typed params, inputs,
stream), checking the rules JSON Schema cannot express. Response side: ``GenerationResult`` / ``TokenEvent``
→ the JSON of docs/api.md (a one-element list, ``/generate``'s object, SSE events); errors are
``{"error", "error_type"}``. ``/generate`` and ``/generate_stream`` take the same body as ``POST /``; the
route fixes the response mode (a ``stream`` field in the body is still checked as on ``POST /``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from backends.base import Backend
from backends.errors import BackendError, ParameterRejected
from backends.types import FinishReason, GenerationResult, Grammar, RequestParams, Token, TokenEvent
from service import sse
from service.context import AppContext, RequestLimits
from service.dialects import json_schema_grammar, stop_sequences
from service.errors import ServiceError, ValidationError, error_body, from_backend_error
from service.media.kinds import TEXT_PART
from service.media.parts import MediaRef, media_refs
from service.validation import show

BASE_MODEL_ADAPTER = "None"
_BOOL_FIELDS = ("watermark", "decoder_input_details", "speculate")
_FLOAT_FIELDS = ("temperature", "top_p", "typical_p", "repetition_penalty")
_INT_FIELDS = ("top_k", "seed", "truncate", "max_new_tokens", "priority")

TokenIdFormat = Literal["list", "int"]


@dataclass(frozen=True, slots=True)
class InputPart:
    type: str  # "text" | "image_url" | "video_url" | "audio_url"
    value: str  # the text, or the media reference (path, URL or base64 data)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    inputs: str | tuple[InputPart, ...]
    params: RequestParams = field(default_factory=RequestParams)
    stream: bool = False
    details: bool = False  # the client's `details` flag (decoder_input_details lives in params)
    return_full_text: bool = False  # prepend the text inputs to generated_text (a rendering choice)
    choices: int = 1  # TGI generates one sequence per request
    media: tuple[MediaRef, ...] = ()  # the media parts, checked but not loaded (service/media/)

    @property
    def want_details(self) -> bool:
        """Whether the response carries ``details`` (either flag true)."""
        return self.details or self.params.decoder_input_details

    @property
    def prompt_text(self) -> str:
        """The original text inputs (text parts joined for a list), as return_full_text prepends it."""
        if isinstance(self.inputs, str):
            return self.inputs
        return "".join(part.value for part in self.inputs if part.type == TEXT_PART)

    def render_prompt(self, backend: Backend) -> str:
        return self.prompt_text

    def place_media(self, prompt: str, media: tuple) -> tuple[str, tuple]:
        """Each part already sits at its position among the text parts."""
        return prompt, media


def parse_generate_request(body: dict[str, Any], *, limits: RequestLimits = RequestLimits()) -> ParsedRequest:
    """Convert a body that passed ``generate_request.schema.json``; cross-field errors → ``ValidationError``."""
    raw: dict[str, Any] = body.get("parameters") or {}
    inputs = _parse_inputs(body["inputs"], limits)
    params = _parse_params(raw, limits)
    stream = bool(body.get("stream"))
    # decoder_input_details with stream true: the schema refuses it (generate_request.schema.json's allOf)
    return ParsedRequest(inputs=inputs, params=params, stream=stream, details=bool(raw.get("details")),
                         return_full_text=bool(raw.get("return_full_text")))


# --- request ---------------------------------------------------------------------------------------

def _parse_inputs(inputs: str | list[Any], limits: RequestLimits) -> str | tuple[InputPart, ...]:
    if isinstance(inputs, str):
        return inputs
    parts = tuple(_parse_part(part) for part in inputs)
    media_types = limits.media_types or frozenset()
    for index, part in enumerate(parts):
        if part.type != TEXT_PART and part.type not in media_types:
            accepted = ", ".join([TEXT_PART, *sorted(media_types)])
            raise ValidationError(
                f'inputs[{index}] has type "{part.type}", which this model does not accept '
                f"(accepted part types: {accepted})"
            )
    return parts


def _parse_part(part: dict[str, Any]) -> InputPart:
    kind = part["type"]
    value = part[kind]
    if isinstance(value, dict):  # OpenAI form {"url": ...}
        value = value["url"]
    return InputPart(type=kind, value=value)


def _parse_params(raw: dict[str, Any], limits: RequestLimits) -> RequestParams:
    kwargs: dict[str, Any] = {}
    for name in _BOOL_FIELDS:
        if raw.get(name) is not None:
            kwargs[name] = bool(raw[name])
    if raw.get("do_sample") is not None:
        kwargs["do_sample"] = bool(raw["do_sample"])
    for name in _FLOAT_FIELDS:
        if raw.get(name) is not None:
            kwargs[name] = float(raw[name])  # finite: parse_json_body refuses the others
    for name in _INT_FIELDS:
        if raw.get(name) is not None:
            kwargs[name] = int(raw[name])  # JSON Schema also calls 20.0 an integer
    kwargs["stop"] = stop_sequences(raw.get("stop"), "parameters.stop", ValidationError)
    kwargs["adapter_id"] = _parse_adapter(raw.get("adapter_id"), limits)
    kwargs["grammar"] = _parse_grammar(raw.get("grammar"))
    return RequestParams(**kwargs)


def _parse_grammar(grammar: dict[str, Any] | None) -> Grammar | None:
    """TGI's ``{"type": "json", "value": <JSON Schema>}`` or ``{"type": "regex", "value": "..."}``."""
    if grammar is None:
        return None
    if grammar["type"] == "regex":
        return Grammar("regex", grammar["value"])
    return json_schema_grammar(grammar["value"], "parameters.grammar.value", ValidationError)


def _parse_adapter(adapter_id: str | None, limits: RequestLimits) -> str | None:
    if adapter_id is None or adapter_id == BASE_MODEL_ADAPTER:
        return None
    if limits.adapter_ids is not None and adapter_id not in limits.adapter_ids:
        loaded = ", ".join(sorted(limits.adapter_ids)) or "none"
        raise ValidationError(
            f"parameters.adapter_id {show(adapter_id)} is not a loaded adapter (loaded: {loaded})"
        )
    return adapter_id


# --- response --------------------------------------------------------------------------------------

def render_token(token: Token) -> dict[str, Any]:
    return {"id": token.id, "logprob": token.logprob, "special": token.special, "text": token.text}


def render_response(result: GenerationResult, req: ParsedRequest) -> list[dict[str, Any]]:
    """The non-stream body of ``POST /``: a one-element list (``/generate`` sends the element alone)."""
    body: dict[str, Any] = {}
    if req.want_details:
        body["details"] = {
            "prompt_tokens": result.prompt_tokens,
            "finish_reason": FinishReason(result.finish_reason).value,
            "generated_tokens": result.generated_tokens,
            "prefill": [render_token(t) for t in result.prefill] if req.params.decoder_input_details else [],
            "seed": result.seed,
            "tokens": [render_token(t) for t in result.tokens],
        }
    body["generated_text"] = _full_text(result, req)
    return [body]


def render_stream_event(
    event: TokenEvent,
    *,
    token_id_format: TokenIdFormat = "list",
    full_text: str | None = None,
    final_result: GenerationResult | None = None,
    want_details: bool = False,
    text_prefix: str = "",
) -> dict[str, Any]:
    """One SSE event. ``full_text``: the whole text so far (fullTextEnabled) replacing the token's text.

    With ``final_result`` this is the last event: it carries ``text_prefix`` + the generated text, and the
    stream details when ``want_details``.
    """
    token = event.token
    out: dict[str, Any] = {
        "token": {
            "id": [token.id] if token_id_format == "list" else token.id,
            "text": event.text if full_text is None else full_text,
            "logprob": token.logprob,
            "special": token.special,
        },
        "generated_text": None,
        "details": None,
    }
    if final_result is not None:
        out["generated_text"] = text_prefix + final_result.generated_text
        if want_details:
            out["details"] = {
                "prompt_tokens": final_result.prompt_tokens,
                "finish_reason": FinishReason(final_result.finish_reason).value,
                "generated_tokens": final_result.generated_tokens,
                "seed": final_result.seed,
            }
    return out


class StreamRenderer:
    """Renders the events of one stream, keeping the text so far for ``fullTextEnabled``."""

    def __init__(self, req: ParsedRequest, *, token_id_format: TokenIdFormat = "list",
                 full_text_enabled: bool = False) -> None:
        self._req = req
        self._token_id_format = token_id_format
        self._full_text_enabled = full_text_enabled
        self._text = ""

    def event(self, event: TokenEvent, final_result: GenerationResult | None = None) -> dict[str, Any]:
        """Render ``event``; pass ``final_result`` for the stream's last token."""
        self._text += event.text
        return render_stream_event(
            event,
            token_id_format=self._token_id_format,
            full_text=self._text if self._full_text_enabled else None,
            final_result=final_result,
            want_details=self._req.details,
            text_prefix=self._req.prompt_text if self._req.return_full_text else "",
        )


def _full_text(result: GenerationResult, req: ParsedRequest) -> str:
    prefix = req.prompt_text if req.return_full_text else ""
    return prefix + result.generated_text


# --- the codec ---------------------------------------------------------------------------------------

class Route(enum.Enum):
    """How the route answers: ``POST /`` as the body asks, ``/generate`` one object, ``/generate_stream`` SSE."""

    ROOT = "/"
    OBJECT = "/generate"
    STREAM = "/generate_stream"


class TGIStream:
    """One stream's events. The final token waits for its result, to be sent with ``generated_text``;
    every other token goes out the moment it exists (the first one is the TTFT)."""

    def __init__(self, renderer: StreamRenderer) -> None:
        self._renderer = renderer
        self._held: TokenEvent | None = None

    def on_token(self, event: TokenEvent) -> list[str]:
        out = [] if self._held is None else [sse.event(self._renderer.event(self._held))]
        self._held = None
        if event.last:  # its result follows at once
            self._held = event
        else:
            out.append(sse.event(self._renderer.event(event)))
        return out

    def on_result(self, result: GenerationResult) -> list[str]:
        if self._held is None:
            return []
        return [sse.event(self._renderer.event(self._held, final_result=result))]

    def on_error(self, error: ServiceError) -> list[str]:
        return [sse.event(error_body(error))]


@dataclass(frozen=True, slots=True)
class TGIDialect:
    route: Route = Route.ROOT

    def requested_model(self, body: Any) -> None:
        """TGI bodies name no model: the first one serves them."""
        return None

    def parse(self, body: Any, ctx: AppContext) -> ParsedRequest:
        ctx.schemas.validate("generate_request", body)
        req = parse_generate_request(body, limits=ctx.request_limits())
        if not isinstance(req.inputs, str):
            req = replace(req, media=media_refs([(part.type, part.value) for part in req.inputs]))
        if self.route is Route.OBJECT:
            return replace(req, stream=False)
        if self.route is Route.STREAM:
            if req.params.decoder_input_details:
                raise ValidationError("parameters.decoder_input_details must not be true on /generate_stream, "
                                      "got true")
            return replace(req, stream=True)
        return req

    def submit_error(self, error: BackendError, req: ParsedRequest) -> ServiceError:
        if isinstance(error, ParameterRejected) and error.param == "grammar":
            return ValidationError(f"parameters.grammar does not compile: {error}")
        if isinstance(error, ParameterRejected) and error.param == "adapter_id":
            return ValidationError(f"parameters.adapter_id {error}")
        return from_backend_error(error)

    def render_result(self, req: ParsedRequest, results: list[GenerationResult], ctx: AppContext) -> Any:
        body = render_response(results[0], req)
        return body if self.route is Route.ROOT else body[0]

    def stream_codec(self, req: ParsedRequest, ctx: AppContext) -> TGIStream:
        return TGIStream(StreamRenderer(req, token_id_format=ctx.settings.token_id_format,
                                        full_text_enabled=ctx.settings.full_text_enabled))

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        return error.status, error_body(error)
