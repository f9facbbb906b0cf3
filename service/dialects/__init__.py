"""Dialects: the wire formats of generation. Each is a codec plus its routes; ``service/pipeline.py`` does the rest.

A codec parses a body into a ``GenerationRequest`` (prompt, typed params, stream flag), renders a result,
renders a stream one event at a time (``StreamCodec``) and renders an error. ``tgi.py`` is ``POST /``,
``/generate`` and ``/generate_stream``; ``openai.py`` is ``/v1/completions`` and ``/v1/chat/completions``;
``openai_responses.py`` is ``/v1/responses`` and ``anthropic.py`` is ``/v1/messages`` (each a translation into
a chat request). Another dialect is one more module here and its routes in ``service/app.py``.

The request rules every dialect shares live here too (the stop list, a grammar's text, the seed of each
choice).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from backends.base import Backend
from backends.errors import BackendError
from backends.types import GenerationResult, Grammar, RequestParams, TokenEvent
from service.context import AppContext
from service.errors import ServiceError

STOP_TOTAL_MAX_CHARS = 32768


class GenerationRequest(Protocol):
    """What the pipeline needs of a parsed request."""

    params: RequestParams
    stream: bool
    choices: int  # sequences generated for the prompt (OpenAI's n); a stream has one
    media: tuple  # service.media.parts.MediaRef of each media part, in order; loaded by the pipeline

    def render_prompt(self, backend: Backend) -> str:
        """The text to generate from (a chat request renders its messages here, off the event loop)."""

    def place_media(self, prompt: str, media: tuple) -> tuple[str, tuple]:
        """``prompt`` (from ``render_prompt``) and the loaded ``MediaInput``s with their final positions in it."""


class StreamCodec(Protocol):
    """The SSE events of one stream, each an already framed ``data: ...`` string."""

    def on_token(self, event: TokenEvent) -> list[str]: ...

    def on_result(self, result: GenerationResult) -> list[str]: ...

    def on_error(self, error: ServiceError) -> list[str]:
        """A failure after the stream opened (the status line is sent already)."""


class Dialect(Protocol):
    def requested_model(self, body: Any) -> str | None:
        """The model a body names (None: the first model; a body of the wrong shape is parse's to refuse)."""

    def parse(self, body: Any, ctx: AppContext) -> GenerationRequest:
        """A JSON body (not yet schema-checked) → the request; raises the dialect's validation errors."""

    def submit_error(self, error: BackendError, req: GenerationRequest) -> ServiceError:
        """The error for a request the backend refused at submit (e.g. a prompt over the token limit)."""

    def render_result(self, req: GenerationRequest, results: list[GenerationResult], ctx: AppContext) -> Any:
        """The non-stream body of ``req``'s results, one per choice."""

    def stream_codec(self, req: GenerationRequest, ctx: AppContext) -> StreamCodec: ...

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        """(status sent, JSON body)."""


def body_model(body: Any) -> str | None:
    """An OpenAI body's ``model`` when it is a string (else None: the schema check refuses it)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def stop_sequences(stop: str | list[str] | None, field: str,
                   invalid: Callable[[str], ServiceError]) -> tuple[str, ...]:
    """A schema-valid ``stop`` (one string or a list) as a tuple; a list over ``STOP_TOTAL_MAX_CHARS``
    characters in all raises ``invalid(message)``, the message naming ``field``."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    total = sum(len(s) for s in stop)
    if total > STOP_TOTAL_MAX_CHARS:
        raise invalid(f"{field} must total at most {STOP_TOTAL_MAX_CHARS} characters, "
                      f"got {total} in {len(stop)} strings")
    return tuple(stop)


def json_schema_grammar(schema: dict[str, Any] | str, field: str, invalid: Callable[[str], ServiceError]) -> Grammar:
    """A JSON Schema (an object, or its text) as the engine's grammar; the engine compiles it."""
    if isinstance(schema, str):
        return Grammar("json", schema)
    try:
        return Grammar("json", json.dumps(schema, separators=(",", ":")))
    except RecursionError:
        raise invalid(f"{field} nests too deeply") from None


def choice_params(params: RequestParams, index: int) -> RequestParams:
    """The parameters of choice ``index``: choice 0 is the request; the others sample with the request's
    seed + index (wrapping within 1..2**64-1), or a seed of their own when the request set none."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed - 1 + index) % (2**64 - 1) + 1)
