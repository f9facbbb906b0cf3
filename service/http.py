"""The handler bases every route builds on: error rendering, request ids, connection accounting, JSON bodies.

``BaseHandler`` turns any failure into the taxonomy of ``service/errors.py`` and renders it in its route's
error shape (``render_error``; the generation dialects override it). ``JsonBodyHandler`` reads a JSON body
into one buffer under the reading bound of ``service/connections.py``: 413 before the body is held whole, 408
when it has not arrived within ``bodyTimeout``, 429 when too many requests are reading bodies already, 503
when the bodies held would pass ``maxBufferedBodyMB``.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar

import tornado.ioloop
import tornado.routing
import tornado.web

from backends.errors import BackendError
from service.access_log import REQUEST_ID_HEADER, log_request, request_id_for
from service.auth import SCHEME, key_refusal
from service.body import (BodyBuffer, check_content_type, decode_body, declared_length, parse_json_body,
                          too_large)
from service.context import AppContext
from service.errors import (MethodNotAllowed, NotFound, RequestTimeout, ServiceError, ServiceUnavailable,
                            TooManyRequests, Unauthorized, error_body, for_status, from_backend_error)
from service.jsonio import dumps

log = logging.getLogger("mindserve.http")


class BaseHandler(tornado.web.RequestHandler):
    """Renders every error with the taxonomy's status; tells the connection tracker when a request starts
    and ends on its connection; logs a request whose client left before it ended as ``CLIENT_GONE``."""

    client_gone = False
    public: ClassVar[bool] = False  # answered without the API key (service/auth.py)
    openai_401: ClassVar[bool] = False  # an OpenAI route: its 401 in OpenAI's shape (its clients read it so)

    def initialize(self, ctx: AppContext) -> None:
        self.ctx = ctx
        self.ctx.connections.request_started(self.request.connection.stream)

    def prepare(self) -> Any:
        refusal = self.key_refusal()
        if refusal is not None:
            raise refusal

    def key_refusal(self) -> Unauthorized | None:
        """The 401 of a request without the server's API key on a route that is not public."""
        if self.public:
            return None
        return key_refusal(self.ctx.settings.api_key, self.request.headers.get("Authorization"))

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header(REQUEST_ID_HEADER, self.request_id)

    @functools.cached_property
    def request_id(self) -> str:
        """This request's id: the client's valid ``X-Request-Id``, else a new one (echoed in the reply)."""
        return request_id_for(self.request)

    def write_json(self, obj: Any) -> None:
        self.write(dumps(obj))

    def as_service_error(self, status_code: int, exc: BaseException | None) -> ServiceError:
        """Any failure as the taxonomy's error; internal faults are masked (nothing leaks)."""
        if isinstance(exc, ServiceError):
            return exc
        if isinstance(exc, tornado.web.HTTPError) and exc.status_code == 405:
            return MethodNotAllowed(f"method {self.request.method} is not allowed on {self.request.path}")
        if isinstance(exc, tornado.web.HTTPError):
            return for_status(exc.status_code, exc.log_message or self._reason)
        if exc is None or (status_code < 500 and not isinstance(exc, BackendError)):
            return for_status(status_code, self._reason)
        return from_backend_error(exc if isinstance(exc, Exception) else RuntimeError())

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        """(status, JSON body) of an error on this route: POST /'s ``{"error", "error_type"}``; a 401 on an OpenAI
        route (``openai_401``) in OpenAI's shape, which its clients read as an authentication error."""
        if isinstance(error, Unauthorized) and self.openai_401:
            from service.dialects.openai import openai_error  # the dialect imports this module

            return openai_error(error)
        return error.status, error_body(error)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        status, body = self.render_error(self.as_service_error(status_code, kwargs.get("exc_info", (None,) * 3)[1]))
        if status == 405:  # RFC 9110: a 405 lists the methods the path is served with
            self.set_header("Allow", ", ".join(allowed_methods(self.application, self.request.path)))
        if status == 401:
            self.set_header("WWW-Authenticate", SCHEME)
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(dumps(body))

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

    def on_finish(self) -> None:
        self.ctx.connections.request_ended(self.request.connection.stream)

    def on_connection_close(self) -> None:
        """The client left before the response ended: the access log says ``CLIENT_GONE`` (499)."""
        super().on_connection_close()
        self.client_gone = True
        self.ctx.connections.request_ended(self.request.connection.stream)


def allowed_methods(app: tornado.web.Application, path: str) -> list[str]:
    """The methods some route of ``app`` serves ``path`` with: the methods each matching route's handler
    implements (several routes share ``/``: the playground's, the root document's, ``POST /``'s)."""
    methods: set[str] = set()
    for rule in app.wildcard_router.rules:
        target = rule.target
        if (isinstance(rule.matcher, tornado.routing.PathMatches) and rule.matcher.regex.match(path)
                and isinstance(target, type) and issubclass(target, tornado.web.RequestHandler)):
            methods |= {m for m in target.SUPPORTED_METHODS
                        if getattr(target, m.lower()) is not getattr(tornado.web.RequestHandler, m.lower())}
    return [m for m in tornado.web.RequestHandler.SUPPORTED_METHODS if m in methods]


class GetHandler(BaseHandler):
    """A GET route that also answers HEAD: the same status and headers, no body (Tornado drops it)."""

    def head(self, *args: str) -> None:
        return self.get(*args)


class NotFoundHandler(BaseHandler):
    public = True

    def prepare(self) -> None:
        raise NotFound(f"no route for {self.request.method} {self.request.path}")


_NO_BODY_CAP = 1 << 62  # Tornado's own cap would drop the connection; JsonBodyHandler answers 413 itself


@tornado.web.stream_request_body
class JsonBodyHandler(BaseHandler):
    """A POST route whose body is JSON, read into one buffer under the reading bound.

    A body declared or found to be over ``maxRequestLength`` is answered 413 at once (the connection then
    closes, the rest unread), as are a full reading bound (429), a body that would take the held body bytes
    past ``maxBufferedBodyMB`` (503) and a body not in within ``bodyTimeout`` (408). A declared
    ``Content-Length`` is held (allocated and counted) whole before the first byte is read; a chunked body
    counts as it arrives. The bytes count until they are parsed (``json_body``) or refused. Any other refusal
    decided before the body arrives (415, 503) is kept in ``refuse`` and raised once the body has been read
    and dropped unkept, so the client reads the answer rather than a reset connection.
    """

    _buffer: BodyBuffer | None = None
    _refusal: ServiceError | None = None
    _reading = False
    _held = 0  # body bytes counted against maxBufferedBodyMB
    _body_timer: object | None = None

    def prepare(self) -> Any:
        if self.request.method != "POST":
            return None
        limit = self.ctx.settings.max_request_bytes
        self.request.connection.set_max_body_size(_NO_BODY_CAP)
        length = declared_length(self.request.headers, limit)  # 413 now, the body unread
        if not self.ctx.connections.start_reading():
            raise TooManyRequests(f"the server is busy: {self.ctx.connections.reading} requests are reading "
                                  f"their body (maxReadingRequests {self.ctx.settings.max_reading_requests}); "
                                  "retry later")
        self._reading = True
        self._buffer = BodyBuffer(limit)
        unauthorized = self.key_refusal()
        if unauthorized is not None:
            self.refuse(unauthorized)
        self._body_timer = tornado.ioloop.IOLoop.current().call_later(self.ctx.settings.body_timeout,
                                                                      self._body_timed_out)
        try:
            check_content_type(self.request.headers.get("Content-Type"))
        except ServiceError as exc:
            self.refuse(exc)
        if self._refusal is None and length:
            if not self._hold(length):
                raise self._buffered_full()  # 503 now, the body unread
            self._buffer = BodyBuffer(limit, length)
        return None

    def refuse(self, error: ServiceError) -> None:
        """Answer ``error`` once the body is in (the first refusal wins); what arrives until then is dropped."""
        if self._refusal is None:
            self._refusal = error
        self._release_body()

    def data_received(self, chunk: bytes) -> None:
        if self._finished or self._buffer is None or not self._reading:
            return
        if self._refusal is not None:
            ok = self._buffer.discard(chunk)
        elif not self._buffer.preallocated and not self._hold(len(chunk)):
            return self._answer_now(self._buffered_full())
        else:
            ok = self._buffer.add(chunk)
        if not ok:  # a chunked body past the cap
            self._answer_now(too_large(self._buffer.limit, self._buffer.limit, at_least=True))

    def _hold(self, n: int) -> bool:
        """Count ``n`` more body bytes against maxBufferedBodyMB; False when they do not fit."""
        if not self.ctx.connections.add_body_bytes(n):
            return False
        self._held += n
        return True

    def _buffered_full(self) -> ServiceUnavailable:
        return ServiceUnavailable("the server is busy: the request bodies being read hold maxBufferedBodyMB "
                                  f"({self.ctx.settings.max_buffered_body_bytes >> 20} MB) already; retry later")

    def _release_body(self) -> None:
        """Drop the body's bytes and stop counting them."""
        if self._buffer is not None:
            self._buffer.release()
        if self._held:
            self.ctx.connections.release_body_bytes(self._held)
            self._held = 0

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self._reading and not self._finished:
            self.ctx.connections.timeouts["body"] += 1
            self._answer_now(RequestTimeout(f"request body not received within bodyTimeout "
                                            f"({self.ctx.settings.body_timeout:g} s); {self._buffer.size} bytes "
                                            "arrived"))

    def _answer_now(self, error: ServiceError) -> None:
        """Answer while the body is still arriving (Tornado closes the connection after the response)."""
        self._stop_reading()
        self._release_body()
        self.send_error(error.status, exc_info=(type(error), error, None))

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.ctx.connections.stop_reading()
        if self._body_timer is not None:
            tornado.ioloop.IOLoop.current().remove_timeout(self._body_timer)
            self._body_timer = None

    def _take_body(self) -> bytes | bytearray:
        """The whole body, which the handler then no longer holds; raises the pending refusal, if any."""
        self._stop_reading()
        if self._refusal is not None:
            raise self._refusal
        return self._buffer.take() if self._buffer is not None else self.request.body

    def json_body(self) -> Any:
        """The body parsed. Its buffer is dropped once decoded, before the parse, and its bytes count against
        maxBufferedBodyMB until the parse is done."""
        try:
            text = decode_body(self._take_body())
            return parse_json_body(text)
        finally:
            self._release_body()

    def on_finish(self) -> None:
        self._stop_reading()
        self._release_body()
        super().on_finish()

    def on_connection_close(self) -> None:
        reading = self._reading
        self._stop_reading()
        self._release_body()
        super().on_connection_close()
        if reading:  # gone while its body was read: Tornado will not finish (nor log) this request
            self.on_unfinished()

    def on_unfinished(self) -> None:
        """A request that will never finish: log it (subclasses also settle their own accounting)."""
        log_request(self)
