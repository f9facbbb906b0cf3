"""JSON ↔ typed objects for the OpenAI-compatible routes (/v1/completions, /v1/chat/completions).

Request side: a body → schema check (``openai_*_request.schema.json``) → ``OpenAIRequest`` with the same
``RequestParams`` POST / builds. Response side: ``GenerationResult`` → OpenAI's completion objects and
stream chunks; any service error → OpenAI's error shape ``{"error": {message, type, param, code}}``.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema.exceptions

from backends.types import FinishReason, GenerationResult, RequestParams
from service.errors import NotFound, ServiceError, ValidationError, from_backend_error
from service.protocol import STOP_TOTAL_MAX_CHARS
from service.validation import Schemas, describe, field_path, show

Kind = Literal["completion", "chat"]
SCHEMA = {"completion": "openai_completion_request", "chat": "openai_chat_request"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
UNCAPPED_MAX_TOKENS = 2_147_483_647  # chat default: the engine's length cap decides
MIN_TEMPERATURE = 1e-6  # as parameters.temperature of POST /
DONE_EVENT = "data: [DONE]\n\n"
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop",
                  FinishReason.STOP_SEQUENCE: "stop"}
ROLE_ALIASES = {"developer": "system"}  # HF chat templates know system, not developer

# status → (status sent, OpenAI error type). Validation is 400 here: OpenAI's status for a bad request,
# which the official client raises as BadRequestError (422 would be UnprocessableEntityError).
_OPENAI_STATUS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    404: (404, "invalid_request_error"),
    405: (405, "invalid_request_error"),
    413: (413, "invalid_request_error"),
    415: (415, "invalid_request_error"),
    422: (400, "invalid_request_error"),
    429: (429, "rate_limit_error"),
    503: (503, "service_unavailable_error"),
}
_SERVER_ERROR = "server_error"


class InvalidRequest(ValidationError):
    """A request field is wrong; ``param`` names it (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(NotFound):
    code = "model_not_found"
    param = "model"

    def __init__(self, requested: str, served: str) -> None:
        super().__init__(f"model {show(requested)} is not served here; this server serves {show(served)}")


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    kind: Kind
    prompt: str  # completions: the prompt; chat: empty until the template renders `messages`
    messages: tuple[dict[str, str], ...] = ()
    params: RequestParams = field(default_factory=RequestParams)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False


# --- request ---------------------------------------------------------------------------------------

def parse_openai_request(kind: Kind, body: Any, schemas: Schemas, model_name: str) -> OpenAIRequest:
    """Validate ``body`` and convert it; errors are ``InvalidRequest`` (400) or ``ModelNotFound`` (404)."""
    error = jsonschema.exceptions.best_match(schemas.validator(SCHEMA[kind]).iter_errors(body))
    if error is not None:
        raise InvalidRequest(describe(error), _param_of(error))
    if body["model"] != model_name:
        raise ModelNotFound(body["model"], model_name)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    common = {"params": _params(kind, body), "stream": stream,
              "include_usage": bool(options and options.get("include_usage"))}
    if kind == "chat":
        return OpenAIRequest(kind, "", messages=tuple(_message(m) for m in body["messages"]), **common)
    prompt = body["prompt"]
    return OpenAIRequest(kind, prompt if isinstance(prompt, str) else prompt[0],
                         echo=bool(body.get("echo")), **common)


def _params(kind: Kind, body: dict[str, Any]) -> RequestParams:
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is not None and 0 < temperature <= MIN_TEMPERATURE:
        raise InvalidRequest(f"temperature must be 0 (greedy) or > {MIN_TEMPERATURE}, got {show(temperature)}",
                             "temperature")
    return RequestParams(
        do_sample=False if temperature == 0 else None,
        temperature=float(temperature) if temperature else None,
        top_p=float(top_p) if top_p is not None and top_p < 1 else None,  # 1.0 = off, as OpenAI
        top_k=_int_or_none(body.get("top_k")),
        repetition_penalty=_float_or_none(body.get("repetition_penalty")),
        seed=_int_or_none(body.get("seed")),
        max_new_tokens=_max_tokens(kind, body),
        stop=_stop(body.get("stop")),
    )


def _max_tokens(kind: Kind, body: dict[str, Any]) -> int:
    if kind == "completion":
        value = body.get("max_tokens")
        return COMPLETION_DEFAULT_MAX_TOKENS if value is None else int(value)
    newer, older = body.get("max_completion_tokens"), body.get("max_tokens")
    if newer is not None and older is not None:
        raise InvalidRequest("set max_completion_tokens or max_tokens, not both "
                             f"(got {show(newer)} and {show(older)})", "max_tokens")
    value = newer if newer is not None else older
    return UNCAPPED_MAX_TOKENS if value is None else int(value)


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    total = sum(len(s) for s in stop)
    if total > STOP_TOTAL_MAX_CHARS:
        raise InvalidRequest(f"stop must total at most {STOP_TOTAL_MAX_CHARS} characters, "
                             f"got {total} in {len(stop)} strings", "stop")
    return tuple(stop)


def _message(message: dict[str, Any]) -> dict[str, str]:
    content = message["content"]
    if not isinstance(content, str):
        content = "".join(part["text"] for part in content)
    out = {"role": ROLE_ALIASES.get(message["role"], message["role"]), "content": content}
    if message.get("name") is not None:
        out["name"] = message["name"]
    return out


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)  # JSON Schema also calls 20.0 an integer


def _param_of(error: jsonschema.exceptions.ValidationError) -> str | None:
    """The field OpenAI's ``error.param`` should name: the unknown or missing key, else the path."""
    path = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = error.schema.get("properties", {})
        path += [next((k for k in error.instance if k not in known), "")]
    elif error.validator == "required" and isinstance(error.instance, dict):
        path += [next((k for k in error.validator_value if k not in error.instance), "")]
    return field_path(path) or None


# --- response --------------------------------------------------------------------------------------

def new_response_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(result: GenerationResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens}


def render_completion(req: OpenAIRequest, result: GenerationResult, *, response_id: str, model: str,
                      created: int | None = None) -> dict[str, Any]:
    """The non-stream body: a ``text_completion`` or a ``chat.completion``."""
    finish = FINISH_REASONS[FinishReason(result.finish_reason)]
    if req.kind == "chat":
        object_, choice = "chat.completion", {"message": {"role": "assistant", "content": result.generated_text}}
    else:
        text = (req.prompt if req.echo else "") + result.generated_text
        object_, choice = "text_completion", {"text": text}
    return {"id": response_id, "object": object_, "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}],
            "usage": usage(result)}


class ChunkRenderer:
    """The stream chunks of one response (same id and ``created`` throughout)."""

    def __init__(self, req: OpenAIRequest, *, response_id: str, model: str) -> None:
        self._req = req
        self._head = {"id": response_id,
                      "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
                      "created": int(time.time()), "model": model}

    def opening(self) -> dict[str, Any] | None:
        """The first chunk: the assistant role (chat), the echoed prompt (completions), else None."""
        if self._req.kind == "chat":
            return self._chunk({"role": "assistant", "content": ""})
        return self.text(self._req.prompt) if self._req.echo else None

    def text(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text} if self._req.kind == "chat" else text)

    def finish(self, result: GenerationResult) -> dict[str, Any]:
        finish = FINISH_REASONS[FinishReason(result.finish_reason)]
        return self._chunk({} if self._req.kind == "chat" else "", finish)

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        """The include_usage chunk: no choices, the usage counts."""
        return {**self._head, "choices": [], "usage": usage(result)}

    def _chunk(self, delta: dict[str, str] | str, finish: str | None = None) -> dict[str, Any]:
        content = {"delta": delta} if isinstance(delta, dict) else {"text": delta}
        chunk = {**self._head, "choices": [{"index": 0, **content, "logprobs": None, "finish_reason": finish}]}
        if self._req.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return chunk


# --- errors ----------------------------------------------------------------------------------------

def openai_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) in OpenAI's error shape for any exception (non-service ones leak nothing)."""
    err = exc if isinstance(exc, ServiceError) else from_backend_error(exc)  # internal faults masked
    sent, kind = _OPENAI_STATUS.get(err.status, (err.status, _SERVER_ERROR))
    return sent, {"error": {"message": err.message, "type": kind, "param": getattr(err, "param", None),
                            "code": getattr(err, "code", None)}}
