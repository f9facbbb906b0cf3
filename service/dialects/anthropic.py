"""The Anthropic Messages dialect: ``POST /v1/messages`` on the same engine as the chat route.

Request side: ``anthropic_request.py`` (a translation into a chat request). Response side: a ``message`` with
its content blocks (``anthropic_output.py``), ``stop_reason`` and ``usage``; a stream is ``message_start``,
``ping``, the block events, ``message_delta`` and ``message_stop``, each ``event: <type>``; a failure after the
stream opened is one ``error`` event. Errors are Anthropic's ``{"type": "error", "error": {type, message}}``:
validation 400 ``invalid_request_error``, unknown model 404 ``not_found_error``, a full line of waiting requests
529 ``overloaded_error`` (the client's ``OverloadedError``), 503 ``overloaded_error`` while loading or
draining. The API key may come as ``x-api-key`` (Anthropic's header) or ``Authorization: Bearer``.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from backends.errors import BackendError
from backends.types import GenerationResult, TokenEvent
from service import sse
from service.context import AppContext
from service.dialects.anthropic_output import MessageContent, stop_reason
from service.dialects.anthropic_request import MessagesRequest, parse_messages_request, renamed
from service.dialects import body_model
from service.dialects.openai import CHAT
from service.errors import ServiceError, Unauthorized, from_backend_error
from service.pipeline import GenerationHandler

API_KEY_HEADER = "x-api-key"
OVERLOADED = 529  # Anthropic's status for an overloaded API (the client's OverloadedError)

# status → (status sent, Anthropic error type). Validation is 400, as Anthropic answers it (BadRequestError);
# the server's 429 (no free slot and the line full: the server is overloaded, not a client over its rate) is 529.
_STATUS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    404: (404, "not_found_error"),
    405: (405, "invalid_request_error"),
    408: (408, "timeout_error"),
    413: (413, "request_too_large"),
    415: (415, "invalid_request_error"),
    422: (400, "invalid_request_error"),
    429: (OVERLOADED, "overloaded_error"),
    431: (431, "invalid_request_error"),
    503: (503, "overloaded_error"),
}
_API_ERROR = "api_error"


def anthropic_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) in Anthropic's error shape for any exception (non-service ones leak nothing)."""
    err = exc if isinstance(exc, ServiceError) else from_backend_error(exc)  # internal faults masked
    sent, kind = _STATUS.get(err.status, (err.status, _API_ERROR))
    return sent, {"type": "error", "error": {"type": kind, "message": err.message}}


def key_refusal(api_key: str | None, headers: Any, bearer: Unauthorized | None) -> Unauthorized | None:
    """The 401 of a request without the server's key: an ``x-api-key`` header is checked if sent, else
    ``bearer`` (the ``Authorization`` check) decides."""
    sent = headers.get(API_KEY_HEADER)
    if api_key is None or sent is None:
        return None if api_key is None else bearer
    if hmac.compare_digest(sent.strip().encode(), api_key.encode()):
        return None
    return Unauthorized(f"the API key is not valid ({API_KEY_HEADER}: <key>)")


def usage(result: GenerationResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens, "output_tokens": result.generated_tokens,
            "cache_read_input_tokens": result.cached_tokens}


def message(req: MessagesRequest, model: str, content: list[dict[str, Any]], reason: tuple[str | None, str | None],
            counts: dict[str, Any]) -> dict[str, Any]:
    return {"id": req.message_id, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": counts}


class MessagesStream:
    """One message's events: ``message_start`` and ``ping`` with the first event, the block events as the text
    comes, then the rest of the text, ``message_delta`` and ``message_stop``."""

    def __init__(self, req: MessagesRequest, model: str) -> None:
        self._req, self._model = req, model
        self._content = MessageContent(req.chat.chat)
        self._opened = False
        self._sent = ""

    @staticmethod
    def _events(events: list[dict[str, Any]]) -> list[str]:
        return [f"event: {event['type']}\n" + sse.event(event) for event in events]

    def _open(self) -> list[str]:
        if self._opened:
            return []
        self._opened = True
        counts = {"input_tokens": self._req.counted.tokens or 0, "output_tokens": 0}
        start = message(self._req, self._model, [], (None, None), counts)
        return self._events([{"type": "message_start", "message": start}, {"type": "ping"}])

    def on_token(self, event: TokenEvent) -> list[str]:
        self._sent += event.text
        return self._open() + self._events(self._content.feed(event.text))

    def on_result(self, result: GenerationResult) -> list[str]:
        out = self._open()
        text = result.generated_text
        tail = text[len(self._sent):] if text.startswith(self._sent) else ""
        events = self._content.feed(tail) + self._content.finish()
        reason, matched = stop_reason(result, self._content.called, self._req.stop)
        events += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
                    "usage": {"output_tokens": result.generated_tokens, **_input_counts(result)}},
                   {"type": "message_stop"}]
        return out + self._events(events)

    def on_error(self, error: ServiceError) -> list[str]:
        return self._events([anthropic_error(error)[1]])


def _input_counts(result: GenerationResult) -> dict[str, int]:
    counts = usage(result)
    return {"input_tokens": counts["input_tokens"], "cache_read_input_tokens": counts["cache_read_input_tokens"]}


@dataclass(frozen=True, slots=True)
class MessagesDialect:
    def requested_model(self, body: Any) -> str | None:
        return body_model(body)

    def parse(self, body: Any, ctx: AppContext, *, count: bool = False) -> MessagesRequest:
        return parse_messages_request(body, ctx.schemas, ctx.backend.model_name,
                                      [a["name"] for a in ctx.backend.adapters()], ctx.accepted_part_types()[1:],
                                      ctx.backend, ctx.settings.chat_formats(ctx.backend.model_name),
                                      count=count)

    def submit_error(self, error: BackendError, req: MessagesRequest) -> ServiceError:
        return renamed(CHAT.submit_error(error, req.chat), req.origins)

    def render_result(self, req: MessagesRequest, results: list[GenerationResult], ctx: AppContext) -> Any:
        result = results[0]
        content = MessageContent(req.chat.chat)
        content.feed(result.generated_text)
        content.finish()
        return message(req, model_name(req, ctx), content.blocks, stop_reason(result, content.called, req.stop),
                       usage(result))

    def stream_codec(self, req: MessagesRequest, ctx: AppContext) -> MessagesStream:
        return MessagesStream(req, model_name(req, ctx))

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        return anthropic_error(error)


def model_name(req: MessagesRequest, ctx: AppContext) -> str:
    return req.params.adapter_id or ctx.backend.model_name


MESSAGES = MessagesDialect()


class MessagesHandler(GenerationHandler):
    """``POST /v1/messages``: the generation pipeline with this dialect; the key also as ``x-api-key``."""

    def key_refusal(self) -> Unauthorized | None:
        return key_refusal(self.ctx.settings.api_key, self.request.headers, super().key_refusal())
