"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` on the same engine as POST /.

Choices (also stated in schemas/openai_*.schema.json and schemas/README.md):
- Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, not POST /'s
  ``{"error", "error_type"}``, so that the official clients raise their usual exception classes.
  Request validation errors (schema or semantic, including token limits) are **400**
  ``invalid_request_error`` (``openai.BadRequestError``), as OpenAI answers, not POST /'s 422; an
  unknown ``model`` is 404 ``model_not_found`` (``openai.NotFoundError``); the other statuses are the
  service taxonomy's (413, 429, 424, 500, 503).
- ``max_tokens`` defaults to 16 on /v1/completions (OpenAI's default) and to the length cap on chat.
  ``temperature: 0`` is greedy; an unset temperature follows the model's yaml defaults as on POST /.
- Streams are OpenAI chunks ending with ``data: [DONE]``; a failure after the stream opened is sent as
  one ``data: {"error": {...}}`` event, then the stream closes. A client disconnect cancels the request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import tornado.queues
import tornado.web

from backends.base import Listener, RequestHandle
from backends.errors import BackendError, InputRejected
from backends.types import GenerationResult, TokenEvent
from service import sse
from service.errors import MethodNotAllowed, ServiceError, for_status, from_backend_error
from service.handlers import GenerationHandler
from service.openai_protocol import (DONE_EVENT, ChunkRenderer, InvalidRequest, Kind, OpenAIRequest,
                                     new_response_id, openai_error, parse_openai_request, render_completion)

if TYPE_CHECKING:
    from service.app import AppContext


class OpenAIHandler(GenerationHandler):
    """Shared by both routes: parse, submit, then answer with one JSON object or a chunk stream."""

    kind: ClassVar[Kind]
    prompt_field: ClassVar[str]  # the request field that token-limit errors name

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, tornado.web.HTTPError) and exc.status_code == 405:
            exc = MethodNotAllowed(f"method {self.request.method} is not allowed on {self.request.path}")
        elif isinstance(exc, tornado.web.HTTPError):
            exc = for_status(exc.status_code, exc.log_message or self._reason)
        elif exc is None:
            exc = for_status(status_code, self._reason)
        status, body = openai_error(exc)
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(sse.dumps(body))

    def parse(self) -> OpenAIRequest:
        return parse_openai_request(self.kind, self.json_body(), self.ctx.schemas, self.ctx.backend.model_name)

    async def generate(self) -> None:
        req = self.parse()
        try:
            events = await self.submit(lambda listener: self._submit(req, listener))
        except InputRejected as exc:
            raise InvalidRequest(str(exc), self.prompt_field) from None
        except BackendError as exc:
            raise from_backend_error(exc) from None
        response_id = new_response_id(self.kind)
        if req.stream:
            await self._stream(req, events, ChunkRenderer(req, response_id=response_id,
                                                          model=self.ctx.backend.model_name))
        else:
            await self._json(req, events, response_id)

    def _submit(self, req: OpenAIRequest, listener: Listener) -> RequestHandle:
        prompt = self.ctx.backend.apply_chat_template(req.messages) if self.kind == "chat" else req.prompt
        return self.ctx.backend.submit(prompt, req.params, listener)

    async def _json(self, req: OpenAIRequest, events: tornado.queues.Queue, response_id: str) -> None:
        while True:
            event = await self.next_event(events)
            if isinstance(event, GenerationResult):
                self.write_json(render_completion(req, event, response_id=response_id,
                                                  model=self.ctx.backend.model_name))
                return

    async def _stream(self, req: OpenAIRequest, events: tornado.queues.Queue, chunks: ChunkRenderer) -> None:
        sent = ""  # text sent so far; the result's generated_text may hold a tail not yet sent
        started = False
        while not self._closed:
            try:
                event = await self.next_event(events)
            except ServiceError as exc:
                if not started:
                    raise
                await self.send(sse.event(openai_error(exc)[1]))
                return
            if not started:
                started = True
                for name, value in sse.HEADERS.items():
                    self.set_header(name, value)
                opening = chunks.opening()
                if opening is not None:
                    await self.send(sse.event(opening))
            if isinstance(event, TokenEvent):
                text = event.text  # what this token adds to the generated text
                if text:
                    sent += text
                    await self.send(sse.event(chunks.text(text)))
            elif isinstance(event, GenerationResult):
                tail = event.generated_text[len(sent):] if event.generated_text.startswith(sent) else ""
                if tail:
                    await self.send(sse.event(chunks.text(tail)))
                await self.send(sse.event(chunks.finish(event)))
                if req.include_usage:
                    await self.send(sse.event(chunks.usage(event)))
                await self.send(DONE_EVENT)
                return


class CompletionsHandler(OpenAIHandler):
    """``POST /v1/completions``."""

    kind = "completion"
    prompt_field = "prompt"


class ChatCompletionsHandler(OpenAIHandler):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    kind = "chat"
    prompt_field = "messages"


def openai_routes(ctx: AppContext) -> list[tuple[str, type[tornado.web.RequestHandler], dict[str, Any]]]:
    """The routes to add to ``make_app``'s list."""
    return [
        (r"/v1/completions", CompletionsHandler, {"ctx": ctx}),
        (r"/v1/chat/completions", ChatCompletionsHandler, {"ctx": ctx}),
    ]
