"""HTTP handlers: parse and validate at the edge, hand typed params to the backend, render JSON or SSE.

``JsonBodyHandler`` reads JSON bodies in chunks (413/415 before the body is held whole);
``GenerationHandler`` adds what every generation route shares: the admission queue (429), draining
(503), the token and end-to-end deadlines (500), and cancelling the engine request when the client leaves.
"""
from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tornado.gen
import tornado.iostream
import tornado.queues
import tornado.util
import tornado.web

from backends.base import Event, Listener, RequestHandle
from backends.errors import BackendError
from backends.types import GenerationResult, TokenEvent
from service import sse
from service.access_log import REQUEST_ID_HEADER, request_id_for
from service.admission import Deadlines
from service.body import BodyBuffer, check_content_type, declared_length, too_large
from service.errors import (MethodNotAllowed, NotFound, ServiceError, ServiceUnavailable, error_body, for_status,
                            from_backend_error)
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
        elif isinstance(exc, BackendError):
            err = from_backend_error(exc)
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


_NO_BODY_CAP = 1 << 62  # tornado's own cap would drop the connection; JsonBodyHandler answers 413 itself
_STALLED_CLIENT_GRACE = 0.5  # seconds a write may still take once the request's e2eTimeout has passed


@tornado.web.stream_request_body
class JsonBodyHandler(BaseHandler):
    """A POST route whose body is JSON, read in chunks.

    A body declared or found to be over ``maxRequestLength`` is answered 413 at once (the connection
    then closes, the rest unread). Any other refusal decided before the body arrives (415, 503, 429)
    is kept in ``refuse`` and raised once the body has been read and dropped, so the client reads
    the answer rather than a reset connection, and keep-alive survives.
    """

    _buffer: BodyBuffer | None = None
    _refusal: ServiceError | None = None

    def prepare(self) -> Any:
        if self.request.method != "POST":
            return None
        limit = self.ctx.settings.max_request_bytes
        self._buffer = BodyBuffer(limit)
        self.request.connection.set_max_body_size(_NO_BODY_CAP)
        declared_length(self.request.headers, limit)  # 413 now, the body unread
        try:
            check_content_type(self.request.headers.get("Content-Type"))
        except ServiceError as exc:
            self.refuse(exc)
        return None

    def refuse(self, error: ServiceError) -> None:
        """Answer ``error`` once the body is in (the first refusal wins)."""
        if self._refusal is None:
            self._refusal = error

    def data_received(self, chunk: bytes) -> None:
        if self._finished or self._buffer is None:
            return
        if self._refusal is not None:
            self._buffer.discard(chunk)
            ok = self._buffer.size <= self._buffer.limit
        else:
            ok = self._buffer.add(chunk)
        if not ok:  # a chunked body past the cap
            error = too_large(self._buffer.limit, self._buffer.limit, at_least=True)
            self.send_error(error.status, exc_info=(type(error), error, None))

    @property
    def body(self) -> bytes:
        """The whole body; raises the pending refusal, if any."""
        if self._refusal is not None:
            raise self._refusal
        return self._buffer.getvalue() if self._buffer is not None else self.request.body

    def json_body(self) -> Any:
        return parse_json_body(self.body)


class GenerationHandler(JsonBodyHandler):
    """Admission, draining, deadlines and cancellation around one engine request."""

    _handle: RequestHandle | None = None
    _admitted = False
    _posting = False
    _closed = False
    observer: RequestObserver | None = None  # metrics + access-log token counts, from prepare() on
    deadlines: Deadlines | None = None

    async def prepare(self) -> None:
        self.observer = RequestObserver(self.ctx.metrics)
        self.deadlines = Deadlines(self.ctx.settings.token_timeout, self.ctx.settings.e2e_timeout)
        super().prepare()
        if self.request.method != "POST" or self._refusal is not None:
            return
        if not self.ctx.state.ready:
            self.refuse(ServiceUnavailable(self.ctx.state.describe()))
            return
        try:
            await self.ctx.admission.acquire(self.deadlines.e2e_left())
        except ServiceError as exc:
            self.refuse(exc)
            return
        self._admitted = True

    async def post(self) -> None:
        self._posting = True
        await self.generate()

    async def generate(self) -> None:
        raise NotImplementedError

    def on_finish(self) -> None:
        self._release()
        if self.observer is not None:
            self.observer.finish(self.get_status())

    def on_connection_close(self) -> None:
        super().on_connection_close()
        self._closed = True
        if self.observer is not None:
            self.observer.client_gone()
        if self._handle is not None:
            self._handle.cancel()
        if not self._posting:  # gone while its body was read: finish() will not run
            self._release()
            if self.observer is not None:
                self.observer.finish(self.get_status())

    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self.ctx.admission.release()

    async def submit(self, submit: Callable[[Listener], RequestHandle]) -> tornado.queues.Queue:
        """Run ``submit(listener)`` off the loop; the backend's events arrive on the returned queue."""
        events: tornado.queues.Queue = tornado.queues.Queue()
        loop = asyncio.get_running_loop()

        def listener(event: Event) -> None:
            self.observer.on_event(event)
            loop.call_soon_threadsafe(events.put_nowait, event)

        self._handle = await loop.run_in_executor(None, lambda: submit(listener))
        if self._closed:  # the client left while the request was being queued
            self._handle.cancel()
        return events

    async def next_event(self, events: tornado.queues.Queue) -> TokenEvent | GenerationResult:
        """The next event; a failed request raises its service error, a missed deadline cancels it and
        raises ``IncompleteGeneration``."""
        try:
            event = await events.get(timeout=datetime.timedelta(seconds=max(self.deadlines.left(), 0.0)))
        except tornado.util.TimeoutError:
            self._handle.cancel()
            self.observer.fail()
            error = self.deadlines.expired()
            log.warning("%s %s: %s", self._handle.request_id, self.request.path, error.message)
            raise error from None
        if isinstance(event, BackendError):
            raise from_backend_error(event)
        if isinstance(event, TokenEvent):
            self.deadlines.token()
        return event

    async def send(self, chunk: str) -> None:
        """Write and flush; a client gone or not reading past the request's e2eTimeout cancels it."""
        self.write(chunk)
        wait = datetime.timedelta(seconds=max(self.deadlines.e2e_left(), _STALLED_CLIENT_GRACE))
        try:
            await tornado.gen.with_timeout(wait, self.flush(), quiet_exceptions=tornado.iostream.StreamClosedError)
        except tornado.iostream.StreamClosedError:
            self.on_connection_close()
        except tornado.util.TimeoutError:
            log.warning("%s %s: the client stopped reading; closing", self._handle.request_id, self.request.path)
            self.request.connection.close()
            self.on_connection_close()


class GenerateHandler(GenerationHandler):
    """``POST /``: TGI 0.9.4 compat generation, text (a one-element list) or SSE."""

    wrap_in_list = True

    def parse(self) -> ParsedRequest:
        body = self.json_body()
        self.ctx.schemas.validate("generate_request", body)
        return parse_generate_request(body, limits=self.ctx.limits)

    async def generate(self) -> None:
        req = self.parse()
        try:
            events = await self.submit(lambda listener: self.ctx.backend.submit(req.prompt_text, req.params,
                                                                                 listener))
        except BackendError as exc:
            raise from_backend_error(exc) from None
        if req.stream:
            await self._stream(req, events)
        else:
            await self._text(req, events)
        log.debug("%s %s done in %.3fs", self._handle.request_id, self.request.path,
                  time.monotonic() - self.deadlines.started)

    async def _text(self, req: ParsedRequest, events: tornado.queues.Queue) -> None:
        while True:
            event = await self.next_event(events)
            if isinstance(event, GenerationResult):
                body = render_response(event, req)
                self.write_json(body if self.wrap_in_list else body[0])
                return

    async def _stream(self, req: ParsedRequest, events: tornado.queues.Queue) -> None:
        renderer = StreamRenderer(req, token_id_format=self.ctx.settings.token_id_format,
                                  full_text_enabled=self.ctx.settings.full_text_enabled)
        held: TokenEvent | None = None  # the final token waits for its result, to be sent with generated_text
        while not self._closed:
            try:
                event = await self.next_event(events)
            except ServiceError as exc:
                if not self._headers_written:  # nothing sent yet: a plain JSON error still fits
                    raise
                await self.send(sse.event(error_body(exc)))
                return
            if isinstance(event, TokenEvent):
                if held is not None:
                    await self._send_event(renderer.event(held))
                    held = None
                if event.last:  # its result follows at once
                    held = event
                else:  # every other token goes out the moment it exists (the first one is the TTFT)
                    await self._send_event(renderer.event(event))
            elif isinstance(event, GenerationResult):
                if held is not None:
                    await self._send_event(renderer.event(held, final_result=event))
                return

    async def _send_event(self, event: dict[str, Any]) -> None:
        if not self._headers_written:
            for name, value in sse.HEADERS.items():
                self.set_header(name, value)
        await self.send(sse.event(event))
