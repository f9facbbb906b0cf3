"""The Responses dialect: ``POST /v1/responses`` on the same engine as the chat route, statelessly.

Request side: ``openai_responses_request.py`` (a translation into a chat request). Response side: the output
items (``openai_responses_output.py``) in a ``response`` object with the request's settings echoed and
``usage`` (input, output and reasoning tokens); ``store`` is always false (nothing is stored). A stream is
``response.created``, ``response.in_progress``, the item events, then ``response.completed`` (or
``response.incomplete`` when the length cap cut the output), each ``event: <type>`` with its
``sequence_number``; a failure after the stream opened is an ``error`` event then ``response.failed``.
Errors before are OpenAI's error shape, as on the chat route (``openai.py``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from backends.errors import BackendError
from backends.types import GenerationResult, TokenEvent
from service import sse
from service.context import AppContext
from service.dialects import body_model
from service.dialects.openai import CHAT, openai_error
from service.dialects.openai_responses_output import COMPLETED, INCOMPLETE, IN_PROGRESS, ResponseOutput, cut
from service.dialects.openai_responses_request import ResponsesRequest, parse_responses_request, renamed
from service.errors import ServiceError


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the response states them."""
    body = req.body
    tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict") is not False}
             for t in body.get("tools") or ()]
    choice = body.get("tool_choice") or ("auto" if tools else "none")
    reasoning = body.get("reasoning") or {}
    text = {"format": (body.get("text") or {}).get("format") or {"type": "text"}}
    if (body.get("text") or {}).get("verbosity") is not None:
        text["verbosity"] = body["text"]["verbosity"]
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False, "previous_response_id": None,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": False, "temperature": body.get("temperature"), "text": text, "tool_choice": choice,
            "tools": tools, "top_p": body.get("top_p"), "truncation": "disabled", "user": body.get("user"),
            "metadata": body.get("metadata") or {}}


def response_object(req: ResponsesRequest, model: str, created: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == INCOMPLETE else None
    return {"id": req.response_id, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": incomplete, "model": model, "output": output, **_echo(req), "usage": usage}


def usage(result: GenerationResult, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.generated_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": result.prompt_tokens + result.generated_tokens}


def status_of(result: GenerationResult) -> str:
    return INCOMPLETE if cut(result) else COMPLETED


class ResponsesStream:
    """One response's events, numbered from 0."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self._req, self._model, self._created = req, model, int(time.time())
        self._output = ResponseOutput(req.chat.chat)
        self._sequence = 0
        self._opened = False
        self._sent = ""

    def _events(self, events: list[dict[str, Any]]) -> list[str]:
        out = []
        for event in events:
            event = {**event, "sequence_number": self._sequence}
            self._sequence += 1
            out.append(f"event: {event['type']}\n" + sse.event(event))
        return out

    def _open(self) -> list[str]:
        if self._opened:
            return []
        self._opened = True
        snapshot = response_object(self._req, self._model, self._created, IN_PROGRESS, [])
        return self._events([{"type": "response.created", "response": snapshot},
                             {"type": "response.in_progress", "response": snapshot}])

    def on_token(self, event: TokenEvent) -> list[str]:
        self._sent += event.text
        return self._open() + self._events(self._output.feed(event.text))

    def on_result(self, result: GenerationResult) -> list[str]:
        out = self._open()
        text = result.generated_text
        tail = text[len(self._sent):] if text.startswith(self._sent) else ""
        events = self._output.feed(tail) + self._output.finish(result)
        status = status_of(result)
        final = response_object(self._req, self._model, self._created, status, self._output.items,
                                usage(result, self._output.reasoning_tokens(result)))
        return out + self._events([*events, {"type": f"response.{status}", "response": final}])

    def on_error(self, error: ServiceError) -> list[str]:
        body = openai_error(error)[1]["error"]
        code = body["code"] or body["type"]
        failed = response_object(self._req, self._model, self._created, "failed", self._output.items,
                                 error={"code": code, "message": body["message"]})
        return self._open() + self._events([
            {"type": "error", "code": code, "message": body["message"], "param": body["param"]},
            {"type": "response.failed", "response": failed}])


@dataclass(frozen=True, slots=True)
class ResponsesDialect:
    def requested_model(self, body: Any) -> str | None:
        return body_model(body)

    def parse(self, body: Any, ctx: AppContext) -> ResponsesRequest:
        return parse_responses_request(body, ctx.schemas, ctx.backend.model_name,
                                       [a["name"] for a in ctx.backend.adapters()], ctx.accepted_part_types()[1:],
                                       ctx.backend, ctx.settings.chat_formats(ctx.backend.model_name))

    def submit_error(self, error: BackendError, req: ResponsesRequest) -> ServiceError:
        return renamed(CHAT.submit_error(error, req.chat), req.origins)

    def render_result(self, req: ResponsesRequest, results: list[GenerationResult], ctx: AppContext) -> Any:
        result = results[0]
        output = ResponseOutput(req.chat.chat)
        output.feed(result.generated_text)
        output.finish(result)
        return response_object(req, _model(req, ctx), int(time.time()), status_of(result), output.items,
                               usage(result, output.reasoning_tokens(result)))

    def stream_codec(self, req: ResponsesRequest, ctx: AppContext) -> ResponsesStream:
        return ResponsesStream(req, _model(req, ctx))

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        return openai_error(error)


def _model(req: ResponsesRequest, ctx: AppContext) -> str:
    return req.params.adapter_id or ctx.backend.model_name


RESPONSES = ResponsesDialect()
