"""HTTP handlers: parse and validate at the edge, hand typed params to the backend, render JSON or SSE."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import tornado.iostream
import tornado.queues
import tornado.web

from backends.base import RequestHandle
from backends.errors import BackendError
from backends.types import GenerationResult, TokenEvent
from service import sse
from service.access_log import REQUEST_ID_HEADER, request_id_for
from service.errors import (MethodNotAllowed, NotFound, PayloadTooLarge, ServiceError, error_body,
                            for_status, from_backend_error)
from service.metrics import RequestObserver
from service.protocol import ParsedRequest, StreamRenderer, parse_generate_request, render_response
from service.validation import parse_json_body

if TYPE_CHECKING:
    from service.app import AppContext

log = logging.getLogger("mindserve.http")


class BaseHandler(tornado.web.RequestHandler):
    """Renders every error as ``{"error", "error_type"}`` with the taxonomy's status."""

    def initialize(self, ctx: AppContext) -> None:
        self.ctx = ctx

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header(REQUEST_ID_HEADER, self.request_id)

    @functools.cached_property
    def request_id(self) -> str:
        """This request's id: the client's valid ``X-Request-Id``, else a new one (echoed in the reply)."""
        return request_id_for(self.request)

    def write_json(self, obj: Any) -> None:
        self.write(sse.dumps(obj))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ServiceError):
            err: BaseException = exc
        elif isinstance(exc, tornado.web.HTTPError) and exc.status_code == 405:
            err = MethodNotAllowed(f"method {self.request.method} is not allowed on {self.request.path}")
        elif isinstance(exc, tornado.web.HTTPError):
            err = for_status(exc.status_code, exc.log_message or self._reason)
        else:
            err = for_status(status_code, self._reason) if status_code < 500 else (exc or Exception())
        self.set_status(getattr(err, "status", status_code))
        self.set_header("Content-Type", "application/json")
        self.finish(sse.dumps(error_body(err)))

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ServiceError):
            status_code = exc.status
        super().send_error(status_code, **kwargs)

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, ServiceError):
            log.info("request rejected: %d %s", value.status, value.message)
        else:
            super().log_exception(typ, value, tb)


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        raise NotFound(f"no route for {self.request.method} {self.request.path}")


class GenerateHandler(BaseHandler):
    """``POST /``: TGI 0.9.4 compat generation, text (a one-element list) or SSE."""

    wrap_in_list = True
    _handle: RequestHandle | None = None
    observer: RequestObserver | None = None  # metrics + access-log token counts, from prepare() on

    def prepare(self) -> None:
        self.observer = RequestObserver(self.ctx.metrics)

    def on_finish(self) -> None:
        if self.observer is not None:
            self.observer.finish(self.get_status())

    def parse(self) -> ParsedRequest:
        if len(self.request.body) > self.ctx.settings.max_request_bytes:
            raise PayloadTooLarge(f"request body of {len(self.request.body)} bytes is over maxRequestLength "
                                  f"({self.ctx.settings.max_request_bytes} bytes)")
        body = parse_json_body(self.request.body)
        self.ctx.schemas.validate("generate_request", body)
        return parse_generate_request(body, limits=self.ctx.limits)

    async def post(self) -> None:
        started = time.perf_counter()
        req = self.parse()
        events: tornado.queues.Queue = tornado.queues.Queue()
        loop = asyncio.get_running_loop()

        def listener(event: Any) -> None:
            self.observer.on_event(event)
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            self._handle = await loop.run_in_executor(
                None, lambda: self.ctx.backend.submit(req.prompt_text, req.params, listener))
        except BackendError as exc:
            raise from_backend_error(exc) from None
        if req.stream:
            await self._stream(req, events)
        else:
            await self._text(req, events)
        log.debug("%s %s done in %.3fs", self._handle.request_id, self.request.path, time.perf_counter() - started)

    async def _text(self, req: ParsedRequest, events: tornado.queues.Queue) -> None:
        while True:
            event = await events.get()
            if isinstance(event, BackendError):
                raise from_backend_error(event)
            if isinstance(event, GenerationResult):
                body = render_response(event, req)
                self.write_json(body if self.wrap_in_list else body[0])
                return

    async def _stream(self, req: ParsedRequest, events: tornado.queues.Queue) -> None:
        renderer = StreamRenderer(req, token_id_format=self.ctx.settings.token_id_format,
                                  full_text_enabled=self.ctx.settings.full_text_enabled)
        held: TokenEvent | None = None  # the last token waits to be sent with generated_text
        started = False
        while True:
            event = await events.get()
            if isinstance(event, BackendError):
                if not started:
                    raise from_backend_error(event)
                await self._send(sse.event(error_body(from_backend_error(event))))
                return
            if not started:
                for name, value in sse.HEADERS.items():
                    self.set_header(name, value)
                started = True
            if isinstance(event, TokenEvent):
                if held is not None:
                    await self._send(sse.event(renderer.event(held)))
                held = event
            elif isinstance(event, GenerationResult):
                if held is not None:
                    await self._send(sse.event(renderer.event(held, final_result=event)))
                return

    async def _send(self, chunk: str) -> None:
        self.write(chunk)
        try:
            await self.flush()
        except tornado.iostream.StreamClosedError:
            self.on_connection_close()

    def on_connection_close(self) -> None:
        if self.observer is not None:
            self.observer.client_gone()
        if self._handle is not None:
            self._handle.cancel()
