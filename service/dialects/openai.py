"""The OpenAI dialect: ``POST /v1/completions`` and ``POST /v1/chat/completions`` on the same engine as POST /.

Request side (``openai_request.py``): a body → schema check (``openai_*_request.schema.json``) →
``OpenAIRequest`` with the same ``RequestParams`` POST / builds. Response side (here): ``GenerationResult`` →
OpenAI's completion objects and stream chunks; any service error → OpenAI's error shape
``{"error": {message, type, param, code}}``.

Choices (also stated in schemas/openai_*.schema.json and schemas/README.md):
- Errors use OpenAI's shape, not POST /'s ``{"error", "error_type"}``, so that the official clients raise
  their usual exception classes. Request validation errors (schema or semantic, including token limits)
  are **400** ``invalid_request_error`` (``openai.BadRequestError``), as OpenAI answers, not POST /'s 422;
  an unknown ``model`` is 404 ``model_not_found`` (``openai.NotFoundError``); the other statuses are the
  service taxonomy's (413, 429, 424, 500, 503).
- ``max_tokens`` defaults to 16 on /v1/completions (OpenAI's default) and to the length cap on chat.
  ``temperature: 0`` is greedy; an unset temperature follows the model's yaml defaults as on POST /.
- Streams are OpenAI chunks ending with ``data: [DONE]``; a failure after the stream opened is sent as
  one ``data: {"error": {...}}`` event, then the stream closes. A client disconnect cancels the request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from backends.errors import BackendError, InputRejected, ParameterRejected
from backends.types import FinishReason, GenerationResult, Token, TokenEvent
from service import sse
from service.dialects import body_model
from service.dialects.openai_chat_output import ChatDeltas, finish_reason, render_message
from service.context import AppContext
from service.dialects.openai_request import (MEDIA_MARK, InvalidRequest, Kind, ModelNotFound, OpenAIRequest,
                                             parse_openai_request)
from service.errors import ServiceError, from_backend_error

__all__ = ["CHAT", "COMPLETIONS", "MEDIA_MARK", "ChunkRenderer", "InvalidRequest", "ModelNotFound", "OpenAIDialect",
           "OpenAIRequest", "OpenAIStream", "parse_openai_request", "render_completion"]

DONE_EVENT = "data: [DONE]\n\n"
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop",
                  FinishReason.STOP_SEQUENCE: "stop"}
# the engine's parameter name -> this dialect's field
ENGINE_PARAMS = {"grammar": "response_format", "adapter_id": "model"}

# status → (status sent, OpenAI error type). Validation is 400 here: OpenAI's status for a bad request,
# which the official client raises as BadRequestError (422 would be UnprocessableEntityError).
_OPENAI_STATUS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "invalid_request_error"),
    404: (404, "invalid_request_error"),
    405: (405, "invalid_request_error"),
    413: (413, "invalid_request_error"),
    415: (415, "invalid_request_error"),
    422: (400, "invalid_request_error"),
    429: (429, "rate_limit_error"),
    503: (503, "service_unavailable_error"),
}
_SERVER_ERROR = "server_error"


# --- response --------------------------------------------------------------------------------------

def usage(result: GenerationResult, reasoning: int | None = None) -> dict[str, Any]:
    """The usage counts; ``reasoning`` (a model that reasons): its reasoning tokens, in
    completion_tokens_details."""
    counts: dict[str, Any] = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
                              "total_tokens": result.prompt_tokens + result.generated_tokens,
                              "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
    if reasoning is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return counts


def has_logprob(token: Token, last: bool) -> bool:
    """The one rule for body and stream: a final EOS has no logprob. The last generated token, when
    special, is not reported, whatever the finish reason (an EOS exactly at the length cap finishes as
    "length", backends/stopping.py), since a stream event does not know the finish reason yet."""
    return not (last and token.special)


def reported_tokens(result: GenerationResult) -> tuple[Token, ...]:
    """The tokens logprobs covers: every generated token but a final EOS (``has_logprob``)."""
    last = len(result.tokens) - 1
    return tuple(t for i, t in enumerate(result.tokens) if has_logprob(t, i == last))


def render_logprobs(req: OpenAIRequest, tokens: tuple[Token, ...], offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's logprobs of ``tokens``: chat's ``{"content": [...]}``, completions' parallel lists
    (``offset``: where the first token's text starts in the choice's text)."""
    if not req.logprobs:
        return None
    if req.kind == "chat":
        return {"content": [{**_entry(t), "top_logprobs": [_entry(a) for a in t.top]} for t in tokens],
                "refusal": None}
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.text: a.logprob for a in t.top} for t in tokens] if req.params.top_logprobs else None,
            "text_offset": offsets}


def _entry(token: Token) -> dict[str, Any]:
    return {"token": token.text, "logprob": token.logprob, "bytes": list(token.text.encode("utf-8"))}


def render_completion(req: OpenAIRequest, results: GenerationResult | list[GenerationResult], *, response_id: str,
                      model: str, created: int | None = None) -> dict[str, Any]:
    """The non-stream body: a ``text_completion`` or a ``chat.completion``, one choice per result (n); usage
    counts the prompt once and every choice's tokens."""
    results = [results] if isinstance(results, GenerationResult) else results
    object_ = "chat.completion" if req.kind == "chat" else "text_completion"
    prompt_tokens = results[0].prompt_tokens
    completion_tokens = sum(r.generated_tokens for r in results)
    choices, reasoning = zip(*(_choice(req, i, r) for i, r in enumerate(results)))
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens,
              "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens}}
    if req.chat.fmt.reasoning is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning)}
    return {"id": response_id, "object": object_, "created": created or int(time.time()), "model": model,
            "choices": list(choices), "usage": counts}


def _choice(req: OpenAIRequest, index: int, result: GenerationResult) -> tuple[dict[str, Any], int]:
    """One choice and its reasoning tokens."""
    finish = FINISH_REASONS[FinishReason(result.finish_reason)]
    start = len(req.prompt) if req.kind == "completion" and req.echo else 0
    logprobs = render_logprobs(req, reported_tokens(result), start)
    reasoning = 0
    if req.kind == "chat" and req.chat.parses:
        message, called, reasoning = render_message(req.chat, result)
        choice, finish = {"message": message}, finish_reason(result, called, finish)
    elif req.kind == "chat":
        choice = {"message": {"role": "assistant", "content": result.generated_text}}
    else:
        choice = {"text": (req.prompt if req.echo else "") + result.generated_text}
    return {"index": index, **choice, "logprobs": logprobs, "finish_reason": finish}, reasoning


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

    def text(self, text: str, tokens: tuple[Token, ...] = (), offset: int = 0) -> dict[str, Any]:
        """A text chunk; with logprobs asked, the logprobs of ``tokens`` (the tokens that produced it)."""
        chunk = self._chunk({"content": text} if self._req.kind == "chat" else text)
        if tokens:
            chunk["choices"][0]["logprobs"] = render_logprobs(self._req, tokens, offset)
        return chunk

    def delta(self, delta: dict[str, Any], tokens: tuple[Token, ...] = ()) -> dict[str, Any]:
        """A chat chunk of any delta (reasoning, tool calls); with logprobs asked, those of ``tokens``."""
        chunk = self._chunk(delta)
        if tokens:
            chunk["choices"][0]["logprobs"] = render_logprobs(self._req, tokens)
        return chunk

    def finish(self, result: GenerationResult, called: bool = False) -> dict[str, Any]:
        finish = finish_reason(result, called, FINISH_REASONS[FinishReason(result.finish_reason)])
        return self._chunk({} if self._req.kind == "chat" else "", finish)

    def usage(self, result: GenerationResult, reasoning: int | None = None) -> dict[str, Any]:
        """The include_usage chunk: no choices, the usage counts."""
        return {**self._head, "choices": [], "usage": usage(result, reasoning)}

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None = None) -> dict[str, Any]:
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


# --- the codec ---------------------------------------------------------------------------------------

class OpenAIStream:
    """One response's chunks: the opening chunk with the first event, text as it comes, then the text the
    result holds beyond what was sent, the finish chunk, the usage chunk if asked, and ``[DONE]``."""

    def __init__(self, req: OpenAIRequest, chunks: ChunkRenderer) -> None:
        self._req = req
        self._chunks = chunks
        self._sent = ""  # text sent so far
        self._opened = False
        # tools or reasoning: the text goes through the chat-output parser (openai_chat_output.py)
        self._deltas = ChatDeltas(req.chat) if req.kind == "chat" and req.chat.parses else None

    def _open(self) -> list[str]:
        if self._opened:
            return []
        self._opened = True
        opening = self._chunks.opening()
        return [] if opening is None else [sse.event(opening)]

    def on_token(self, event: TokenEvent) -> list[str]:
        out = self._open()
        if self._deltas is not None:
            return out + self._parsed(event.text, (event.token,) if self._req.logprobs and has_logprob(
                event.token, event.last) else ())
        if self._req.logprobs and has_logprob(event.token, event.last):  # a chunk per token, a final EOS aside
            offset = len(self._sent) + (len(self._req.prompt) if self._req.echo else 0)
            self._sent += event.text
            out.append(sse.event(self._chunks.text(event.text, (event.token,), offset)))
        elif event.text:  # what this token adds to the generated text
            self._sent += event.text
            out.append(sse.event(self._chunks.text(event.text)))
        return out

    def _parsed(self, text: str, tokens: tuple[Token, ...] = ()) -> list[str]:
        """The deltas ``text`` settles, the tokens' logprobs with the first (or alone)."""
        self._sent += text
        deltas = self._deltas.feed(text)
        if tokens and not deltas:
            deltas = [{}]
        return [sse.event(self._chunks.delta(d, tokens if i == 0 else ())) for i, d in enumerate(deltas)]

    def on_result(self, result: GenerationResult) -> list[str]:
        out = self._open()
        text = result.generated_text
        tail = text[len(self._sent):] if text.startswith(self._sent) else ""
        reasoning = None
        if self._deltas is not None:
            out += self._parsed(tail)
            out += [sse.event(self._chunks.delta(d)) for d in self._deltas.finish()]
            out.append(sse.event(self._chunks.finish(result, self._deltas.called)))
            reasoning = self._deltas.reasoning_tokens(result) if self._req.chat.fmt.reasoning is not None else None
        else:
            if tail:
                out.append(sse.event(self._chunks.text(tail)))
            out.append(sse.event(self._chunks.finish(result)))
        if self._req.include_usage:
            out.append(sse.event(self._chunks.usage(result, reasoning)))
        out.append(DONE_EVENT)
        return out

    def on_error(self, error: ServiceError) -> list[str]:
        return [sse.event(openai_error(error)[1])]


@dataclass(frozen=True, slots=True)
class OpenAIDialect:
    kind: Kind
    prompt_field: str  # the request field that token-limit errors name

    def requested_model(self, body: Any) -> str | None:
        return body_model(body)

    def parse(self, body: Any, ctx: AppContext) -> OpenAIRequest:
        return parse_openai_request(self.kind, body, ctx.schemas, ctx.backend.model_name,
                                    [a["name"] for a in ctx.backend.adapters()], ctx.accepted_part_types()[1:],
                                    ctx.backend, ctx.settings.chat_formats(ctx.backend.model_name))

    def submit_error(self, error: BackendError, req: OpenAIRequest) -> ServiceError:
        if isinstance(error, ParameterRejected):
            grammar = req.params.grammar if req is not None else None
            tools = grammar is not None and grammar.kind == "tool_calls"  # the tool-call grammar names "tools"
            param = "tools" if tools and error.param == "grammar" else ENGINE_PARAMS.get(error.param, error.param)
            verb = " does not compile" if error.param == "grammar" else ""
            return InvalidRequest(f"{param}{verb}: {error}", param)
        if isinstance(error, InputRejected):
            return InvalidRequest(str(error), self.prompt_field)
        return from_backend_error(error)

    def render_result(self, req: OpenAIRequest, results: list[GenerationResult], ctx: AppContext) -> Any:
        return render_completion(req, results, response_id=req.response_id,
                                 model=req.params.adapter_id or ctx.backend.model_name)

    def stream_codec(self, req: OpenAIRequest, ctx: AppContext) -> OpenAIStream:
        return OpenAIStream(req, ChunkRenderer(req, response_id=req.response_id,
                                                       model=req.params.adapter_id or ctx.backend.model_name))

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        return openai_error(error)


COMPLETIONS = OpenAIDialect("completion", "prompt")
CHAT = OpenAIDialect("chat", "messages")
