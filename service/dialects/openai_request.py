"""The OpenAI dialect's request side: a ``/v1/completions`` or ``/v1/chat/completions`` body → schema check
(``openai_*_request.schema.json``) → ``OpenAIRequest`` with the same ``RequestParams`` POST / builds. The
choices are stated in ``openai.py``'s docstring."""
from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import jsonschema.exceptions

from backends.base import Backend
from backends.errors import InputRejected
from backends.grammar import ANY_JSON_OBJECT
from backends.types import Grammar, MediaInput, RequestParams
from service.dialects import json_schema_grammar, stop_sequences
from service.dialects.openai_tools import ChatOptions, ToolRequestError, parse_chat_options, template_messages
from service.errors import ValidationError
from service.media.kinds import BY_PART_TYPE
from service.media.parts import MAX_MEDIA_PARTS, MediaRef, media_ref
from service.models import ModelNotFound
from service.validation import Schemas, describe, field_path, show

Kind = Literal["completion", "chat"]
SCHEMA = {"completion": "openai_completion_request", "chat": "openai_chat_request"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
UNCAPPED_MAX_TOKENS = 2_147_483_647  # chat default: the engine's length cap decides
MIN_TEMPERATURE = 1e-6  # as parameters.temperature of POST /
ROLE_ALIASES = {"developer": "system"}  # HF chat templates know system, not developer


class InvalidRequest(ValidationError):
    """A request field is wrong; ``param`` names it (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    chat: ChatOptions = ChatOptions()  # chat: tools, tool_choice, the template's kwargs, the output's format

    def render_prompt(self, backend: Backend) -> str:
        """The text to generate from: chat messages rendered with the model's chat template (each image part
        a ``MEDIA_MARK`` in its message's content until ``place_media``)."""
        if self.kind != "chat":
            return self.prompt
        variables, messages = self.chat.template_variables(), self.chat.prompt_messages(self.messages)
        return backend.apply_chat_template(messages, **variables) if variables else \
            backend.apply_chat_template(messages)

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


class ChatTranslation:
    """A request of another dialect that runs as a chat request (its ``chat``): what the pipeline reads of it."""

    __slots__ = ()
    chat: OpenAIRequest

    @property
    def params(self) -> RequestParams:
        return self.chat.params

    @property
    def stream(self) -> bool:
        return self.chat.stream

    @property
    def choices(self) -> int:
        return 1

    @property
    def media(self) -> tuple:
        return self.chat.media

    def render_prompt(self, backend: Backend) -> str:
        return self.chat.render_prompt(backend)

    def place_media(self, prompt: str, media: tuple) -> tuple[str, tuple]:
        return self.chat.place_media(prompt, media)


def new_response_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def parse_openai_request(kind: Kind, body: Any, schemas: Schemas, model_name: str,
                         adapters: Collection[str] = (), media_types: Collection[str] = (),
                         backend: Backend | None = None, formats: tuple[str, str] = ("auto", "auto")
                         ) -> OpenAIRequest:
    """Validate ``body`` and convert it; errors are ``InvalidRequest`` (400) or ``ModelNotFound`` (404).
    ``model`` is the base model's name, or a LoRA adapter's (``adapters``), which the request then runs with.
    Chat image_url parts only if ``media_types`` (the part types the model takes beside text) has it; tools and
    reasoning as ``backend``'s chat template writes them, or as ``formats`` (the server config's toolCallFormat,
    reasoningFormat) say (``openai_tools.py``)."""
    check_body(schemas, SCHEMA[kind], body)
    if body["model"] != model_name and body["model"] not in adapters:
        raise ModelNotFound(body["model"], [model_name], sorted(adapters))
    adapter = None if body["model"] == model_name else body["model"]
    stream = bool(body.get("stream"))
    choices = int(body.get("n") or 1)
    if choices > 1 and stream:
        raise InvalidRequest(f"n > 1 is not supported with stream, got n {choices}", "n")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    logprobs, top = _logprobs(kind, body)
    common = {"params": replace(_params(kind, body), top_logprobs=top, adapter_id=adapter), "stream": stream,
              "logprobs": logprobs, "choices": choices,
              "include_usage": bool(options and options.get("include_usage")), "response_id": new_response_id(kind)}
    if kind == "chat":
        messages, media = _messages(body["messages"], frozenset(media_types))
        chat, params = _chat_options(body, backend, formats, common["params"])
        return OpenAIRequest(kind, "", messages=messages, media=media, chat=chat, **{**common, "params": params})
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
        priority=int(body.get("priority") or 0),
        speculate=body.get("speculate") is not False,
    )


def _chat_options(body: dict[str, Any], backend: Backend | None, formats: tuple[str, str],
                  params: RequestParams) -> tuple[ChatOptions, RequestParams]:
    """Tools and reasoning: the options, and the parameters with the tool-call grammar and thinking budget."""
    if backend is None:
        return ChatOptions(), params
    try:
        chat, grammar = parse_chat_options(body, backend, formats)
    except ToolRequestError as exc:
        raise InvalidRequest(str(exc), exc.param) from None
    if grammar is not None and params.grammar is not None:
        why = " (this model's tools use the generic format, whose grammar holds every answer)" if chat.generic else ""
        raise InvalidRequest(f"response_format cannot be combined with tool_choice {show(chat.choice)}{why}",
                             "response_format")
    budget = body.get("thinking_budget") if chat.fmt.reasoning is not None else None
    return chat, replace(params, grammar=grammar or params.grammar, thinking_budget=budget)


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
        content = message.get("content") or ""
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


def _message(message: dict[str, Any], content: str) -> dict[str, Any]:
    """A message as the chat template reads it: role, content ("" for none), and the name, tool calls (their
    arguments as objects) and tool_call_id when set."""
    out = {"role": ROLE_ALIASES.get(message["role"], message["role"]), "content": content}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [{**call, "function": dict(call["function"])} for call in message["tool_calls"]]
        template_messages([out])
    return out


def check_body(schemas: Schemas, schema: str, body: Any) -> None:
    """``body`` against the schema named ``schema``; the best error as an ``InvalidRequest`` naming its field."""
    error = schemas.first_error(schema, body)
    if error is not None:
        raise InvalidRequest(describe(error), _param_of(error))


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
