"""JSON ↔ typed objects for ``POST /`` (and /generate, /generate_stream).

Request side: a schema-valid body → ``ParsedRequest`` (``backends.types.RequestParams`` + inputs + stream),
checking the rules JSON Schema cannot express. Response side: ``GenerationResult`` / ``TokenEvent`` → the
JSON of SPEC §1 (non-stream list, SSE events).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.types import FinishReason, GenerationResult, RequestParams, Token, TokenEvent
from service.errors import ValidationError
from service.validation import show

STOP_TOTAL_MAX_CHARS = 32768
PROMPT_TOKENS_HARD_LIMIT = 1_048_576
BASE_MODEL_ADAPTER = "None"
TEXT_PART = "text"
MEDIA_PART_TYPES = ("image_url", "video_url", "audio_url")
# Keys the HuggingFace text-generation client always sends; accepted only with these values.
NEUTRAL_CLIENT_KEYS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "top_n_tokens": (None, 0),
    "frequency_penalty": (None, 0),
    "grammar": (None,),
}
_BOOL_FIELDS = ("watermark", "return_full_text", "decoder_input_details")
_FLOAT_FIELDS = ("temperature", "top_p", "typical_p", "repetition_penalty")
_INT_FIELDS = ("top_k", "seed", "truncate", "max_new_tokens")

TokenIdFormat = Literal["list", "int"]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the served model/server can take, for the checks that depend on it."""

    media_types: frozenset[str] = frozenset()  # part types besides text the model accepts
    adapter_ids: frozenset[str] | None = None  # loaded LoRA adapters; None = not checked here


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


def parse_generate_request(body: dict[str, Any], *, limits: RequestLimits = RequestLimits()) -> ParsedRequest:
    """Convert a body that passed ``generate_request.schema.json``; cross-field errors → ``ValidationError``."""
    raw: dict[str, Any] = body.get("parameters") or {}
    _check_client_keys(raw)
    inputs = _parse_inputs(body["inputs"], limits)
    params = _parse_params(raw, limits)
    stream = bool(body.get("stream"))
    if stream and params.decoder_input_details:
        raise ValidationError("parameters.decoder_input_details must not be true when stream is true, got true")
    return ParsedRequest(inputs=inputs, params=params, stream=stream, details=bool(raw.get("details")))


def check_prompt_tokens(
    n: int, *, max_input_tokens: int, max_seq_len: int, max_position_embeddings: int | None = None
) -> int:
    """Check the prompt's token count (after ``truncate``) and return the limit that applies.

    The limit is min(maxInputTokenLen, maxSeqLen - 1, max_position_embeddings, 1048576); None = unknown.
    """
    candidates = {
        "maxInputTokenLen": max_input_tokens,
        "maxSeqLen - 1": max_seq_len - 1,
        "max_position_embeddings": max_position_embeddings,
        "the server maximum": PROMPT_TOKENS_HARD_LIMIT,
    }
    name, limit = min(((k, v) for k, v in candidates.items() if v is not None), key=lambda kv: kv[1])
    if n < 1:
        raise ValidationError(f"inputs must encode to at least 1 token, got {n}")
    if n > limit:
        raise ValidationError(f"inputs has {n} tokens, more than the limit of {limit} ({name} = {limit})")
    return limit


# --- request ---------------------------------------------------------------------------------------

def _check_client_keys(raw: dict[str, Any]) -> None:
    for name, neutral in NEUTRAL_CLIENT_KEYS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or value not in neutral:
            accepted = " or ".join(show(v) for v in neutral)
            raise ValidationError(f"parameters.{name} is not supported: send {accepted}, got {show(value)}")


def _parse_inputs(inputs: str | list[Any], limits: RequestLimits) -> str | tuple[InputPart, ...]:
    if isinstance(inputs, str):
        return inputs
    parts = tuple(_parse_part(part) for part in inputs)
    for index, part in enumerate(parts):
        if part.type != TEXT_PART and part.type not in limits.media_types:
            accepted = ", ".join([TEXT_PART, *sorted(limits.media_types)])
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
            kwargs[name] = _finite(name, raw[name])
    for name in _INT_FIELDS:
        if raw.get(name) is not None:
            kwargs[name] = int(raw[name])  # JSON Schema also calls 20.0 an integer
    kwargs["stop"] = _parse_stop(raw.get("stop"))
    kwargs["adapter_id"] = _parse_adapter(raw.get("adapter_id"), limits)
    return RequestParams(**kwargs)


def _finite(name: str, value: float) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValidationError(f"parameters.{name} must be a finite number, got {number}")
    return number


def _parse_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    total = sum(len(s) for s in stop)
    if total > STOP_TOTAL_MAX_CHARS:
        raise ValidationError(
            f"parameters.stop must total at most {STOP_TOTAL_MAX_CHARS} characters, "
            f"got {total} in {len(stop)} strings"
        )
    return tuple(stop)


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
            text_prefix=self._req.prompt_text if self._req.params.return_full_text else "",
        )


def _full_text(result: GenerationResult, req: ParsedRequest) -> str:
    prefix = req.prompt_text if req.params.return_full_text else ""
    return prefix + result.generated_text
