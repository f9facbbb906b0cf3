"""The OpenAI dialect: ``POST /v1/completions`` and ``POST /v1/chat/completions`` on the same engine as POST /.

Request side: a body → schema check (``openai_*_request.schema.json``) → ``OpenAIRequest`` with the same
``RequestParams`` POST / builds. Response side: ``GenerationResult`` → OpenAI's completion objects and
stream chunks; any service error → OpenAI's error shape ``{"error": {message, type, param, code}}``.

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
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import jsonschema.exceptions

from backends.base import Backend
from backends.errors import BackendError, InputRejected, ParameterRejected
from backends.grammar import ANY_JSON_OBJECT
from backends.types import FinishReason, GenerationResult, Grammar, MediaInput, RequestParams, Token, TokenEvent
from service import sse
from service.context import AppContext
from service.dialects import json_schema_grammar, stop_sequences
from service.errors import NotFound, ServiceError, ValidationError, from_backend_error
from service.media.kinds import BY_PART_TYPE
from service.media.parts import MAX_MEDIA_PARTS, MediaRef, media_ref
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
ENGINE_PARAMS = {"grammar": "response_format", "adapter_id": "model"}  # the engine's parameter name -> this dialect's field

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

    def __init__(self, requested: str, served: str, adapters: Collection[str] = ()) -> None:
        also = f" and the LoRA adapters {', '.join(map(show, adapters))}" if adapters else ""
        super().__init__(f"model {show(requested)} is not served here; this server serves {show(served)}{also}")


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    kind: Kind
    prompt: str  # completions: the prompt; chat: empty until the template renders `messages`
    messages: tuple[dict[str, str], ...] = ()
    params: RequestParams = field(default_factory=RequestParams)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    response_id: str = ""
    logprobs: bool = False  # choices[].logprobs in OpenAI's shape (the alternatives: params.top_logprobs)
    choices: int = 1  # n: sequences for the prompt (not with stream)
    media: tuple[MediaRef, ...] = ()  # chat: the image_url parts, in order (service/media/)

    def render_prompt(self, backend: Backend) -> str:
        """The text to generate from: chat messages rendered with the model's chat template (each image part
        a ``MEDIA_MARK`` in its message's content until ``place_media``)."""
        return backend.apply_chat_template(self.messages) if self.kind == "chat" else self.prompt

    def place_media(self, prompt: str, media: tuple[MediaInput, ...]) -> tuple[str, tuple[MediaInput, ...]]:
        """The rendered prompt without its media marks, and each loaded part placed where its mark was."""
        if not media:
            return prompt, media
        pieces = prompt.split(MEDIA_MARK)
        if len(pieces) != len(media) + 1:
            raise InputRejected(f"the chat template kept {len(pieces) - 1} of the {len(media)} image parts")
        at, placed = 0, []
        for piece, part in zip(pieces, media):
            at += len(piece)
            placed.append(replace(part, position=at))
        return "".join(pieces), tuple(placed)


# --- request ---------------------------------------------------------------------------------------

def parse_openai_request(kind: Kind, body: Any, schemas: Schemas, model_name: str,
                         adapters: Collection[str] = (), media_types: Collection[str] = ()) -> OpenAIRequest:
    """Validate ``body`` and convert it; errors are ``InvalidRequest`` (400) or ``ModelNotFound`` (404).
    ``model`` is the base model's name, or a LoRA adapter's (``adapters``), which the request then runs with.
    Chat image_url parts only if ``media_types`` (the part types the model takes beside text) has it."""
    error = jsonschema.exceptions.best_match(schemas.validator(SCHEMA[kind]).iter_errors(body))
    if error is not None:
        raise InvalidRequest(describe(error), _param_of(error))
    if body["model"] != model_name and body["model"] not in adapters:
        raise ModelNotFound(body["model"], model_name, sorted(adapters))
    adapter = None if body["model"] == model_name else body["model"]
    stream = bool(body.get("stream"))
    choices = int(body.get("n") or 1)
    if choices > 1 and stream:
        raise InvalidRequest(f"n > 1 is not supported with stream, got n {choices}", "n")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    logprobs, top = _logprobs(kind, body)
    common = {"params": replace(_params(kind, body), top_logprobs=top, adapter_id=adapter), "stream": stream, "logprobs": logprobs, "choices": choices,
              "include_usage": bool(options and options.get("include_usage")), "response_id": new_response_id(kind)}
    if kind == "chat":
        messages, media = _messages(body["messages"], frozenset(media_types))
        return OpenAIRequest(kind, "", messages=messages, media=media, **common)
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
        stop=stop_sequences(body.get("stop"), "stop", lambda message: InvalidRequest(message, "stop")),
        grammar=_grammar(body.get("response_format")),
        logit_bias=tuple((int(tid), float(bias)) for tid, bias in (body.get("logit_bias") or {}).items()),
        ignore_eos=bool(body.get("ignore_eos")),
        min_tokens=int(body.get("min_tokens") or 0),
    )


def _grammar(response_format: dict[str, Any] | None) -> Grammar | None:
    """response_format json_object: any JSON object; json_schema: its schema (none given: any JSON)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return Grammar("json", ANY_JSON_OBJECT)
    if kind == "json_schema":
        schema = response_format["json_schema"].get("schema")
        invalid = lambda message: InvalidRequest(message, "response_format")  # noqa: E731
        return json_schema_grammar({} if schema is None else schema, "response_format.json_schema.schema", invalid)
    return None


def _logprobs(kind: Kind, body: dict[str, Any]) -> tuple[bool, int]:
    """(logprobs wanted, alternatives per token): completions' logprobs is the count; chat's a flag with
    top_logprobs beside it."""
    if kind == "completion":
        count = body.get("logprobs")
        return count is not None, int(count or 0)
    wanted, top = bool(body.get("logprobs")), int(body.get("top_logprobs") or 0)
    if top and not wanted:
        raise InvalidRequest(f"top_logprobs needs logprobs true, got top_logprobs {top}", "top_logprobs")
    return wanted, top


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


MEDIA_MARK = "\ue000"  # a private-use character: where an image part sits, until the chat template has rendered


def _messages(messages: list[dict[str, Any]], media_types: frozenset[str]
              ) -> tuple[tuple[dict[str, str], ...], tuple[MediaRef, ...]]:
    """The messages for the chat template (text parts joined, an image part as ``MEDIA_MARK``) and the image
    parts as media references naming ``messages[i].content[j]``."""
    out, refs = [], []
    for i, message in enumerate(messages):
        content = message["content"]
        if not isinstance(content, str):
            content = "".join(_part(part, f"messages[{i}].content[{j}]", media_types, refs)
                              for j, part in enumerate(content))
        out.append(_message(message, content))
    if refs:
        for i, message in enumerate(out):
            if message["content"].count(MEDIA_MARK) != sum(r.field.startswith(f"messages[{i}].") for r in refs):
                raise InvalidRequest(f"messages[{i}].content has the character U+E000, which this server reserves "
                                     "in a request with image parts", f"messages[{i}].content")
    return tuple(out), tuple(refs)


def _part(part: dict[str, Any], field: str, media_types: frozenset[str], refs: list[MediaRef]) -> str:
    """A content part's text; an image part's reference appended to ``refs`` (its text: ``MEDIA_MARK``)."""
    if part["type"] == "text":
        return part["text"]
    if part["type"] not in media_types:
        accepted = ", ".join(["text", *sorted(media_types)])
        raise InvalidRequest(f'{field} has type "{part["type"]}", which this model does not accept (accepted part '
                             f"types: {accepted})", f"{field}.type")
    if len(refs) == MAX_MEDIA_PARTS:
        raise InvalidRequest(f"{field}: a request may have at most {MAX_MEDIA_PARTS} media parts; this is media "
                             f"part {MAX_MEDIA_PARTS + 1}", field)
    value = part["image_url"]
    refs.append(media_ref(BY_PART_TYPE[part["type"]], value if isinstance(value, str) else value["url"], field))
    return MEDIA_MARK


def _message(message: dict[str, Any], content: str) -> dict[str, str]:
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
    return {"id": response_id, "object": object_, "created": created or int(time.time()), "model": model,
            "choices": [_choice(req, i, r) for i, r in enumerate(results)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _choice(req: OpenAIRequest, index: int, result: GenerationResult) -> dict[str, Any]:
    finish = FINISH_REASONS[FinishReason(result.finish_reason)]
    start = len(req.prompt) if req.kind == "completion" and req.echo else 0
    logprobs = render_logprobs(req, reported_tokens(result), start)
    if req.kind == "chat":
        choice = {"message": {"role": "assistant", "content": result.generated_text}}
    else:
        choice = {"text": (req.prompt if req.echo else "") + result.generated_text}
    return {"index": index, **choice, "logprobs": logprobs, "finish_reason": finish}


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


# --- the codec ---------------------------------------------------------------------------------------

class OpenAIStream:
    """One response's chunks: the opening chunk with the first event, text as it comes, then the text the
    result holds beyond what was sent, the finish chunk, the usage chunk if asked, and ``[DONE]``."""

    def __init__(self, req: OpenAIRequest, chunks: ChunkRenderer) -> None:
        self._req = req
        self._chunks = chunks
        self._sent = ""  # text sent so far
        self._opened = False

    def _open(self) -> list[str]:
        if self._opened:
            return []
        self._opened = True
        opening = self._chunks.opening()
        return [] if opening is None else [sse.event(opening)]

    def on_token(self, event: TokenEvent) -> list[str]:
        out = self._open()
        if self._req.logprobs and has_logprob(event.token, event.last):  # a chunk per token, a final EOS aside
            offset = len(self._sent) + (len(self._req.prompt) if self._req.echo else 0)
            self._sent += event.text
            out.append(sse.event(self._chunks.text(event.text, (event.token,), offset)))
        elif event.text:  # what this token adds to the generated text
            self._sent += event.text
            out.append(sse.event(self._chunks.text(event.text)))
        return out

    def on_result(self, result: GenerationResult) -> list[str]:
        out = self._open()
        text = result.generated_text
        tail = text[len(self._sent):] if text.startswith(self._sent) else ""
        if tail:
            out.append(sse.event(self._chunks.text(tail)))
        out.append(sse.event(self._chunks.finish(result)))
        if self._req.include_usage:
            out.append(sse.event(self._chunks.usage(result)))
        out.append(DONE_EVENT)
        return out

    def on_error(self, error: ServiceError) -> list[str]:
        return [sse.event(openai_error(error)[1])]


@dataclass(frozen=True, slots=True)
class OpenAIDialect:
    kind: Kind
    prompt_field: str  # the request field that token-limit errors name

    def parse(self, body: Any, ctx: AppContext) -> OpenAIRequest:
        return parse_openai_request(self.kind, body, ctx.schemas, ctx.backend.model_name,
                                    [a["name"] for a in ctx.backend.adapters()], ctx.accepted_part_types()[1:])

    def submit_error(self, error: BackendError, req: OpenAIRequest) -> ServiceError:
        if isinstance(error, ParameterRejected):
            param = ENGINE_PARAMS.get(error.param, error.param)
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
