"""Every client connection of a process, and the limits on what a client controls about it.

``ConnectionTracker`` knows each open connection and whether a request is being handled on it. Its sweep
(every ``SWEEP_SECONDS``) closes what a client lets trickle: a request head not complete within
``headerTimeout`` (408 sent, then closed) and a connection idle between requests past ``keepAliveTimeout``.
It also holds the *reading bound*: at most ``maxReadingRequests`` requests reading their body, and at most
``maxBufferedBodyMB`` of body bytes held in all (from arrival, or from a declared ``Content-Length``, until
parsed or refused), so that slow uploads cannot hold the generation slots
(``service/admission.py``), which a request takes only once its body is in. ``bodyTimeout`` is the
handler's (``service/http.py``), so that it can still answer 408. A head over ``maxHeaderBytes`` gets 431.

``start_http_server`` is the one place an ``HTTPServer`` is built (the CLI and the tests call it).
"""
from __future__ import annotations

import collections
import http.client
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import tornado.httpserver
import tornado.ioloop
import tornado.iostream
import tornado.netutil
import tornado.web

from service.access_log import format_fields
from service.config import ServerSettings
from service.errors import HeaderTooLarge, RequestTimeout, ServiceError, error_body
from service.jsonio import dumps

log = logging.getLogger("mindserve.access")

SWEEP_SECONDS = 0.25
LINGER_SECONDS = 2.0  # after a 431, how long the rest of the client's head is read and dropped
LINGER_BYTES = 4 << 20
BACKSTOP_SECONDS = 10.0  # Tornado's own timers, set this much past ours: they only act if the sweep did not
TIMEOUT_KINDS = ("header", "body", "keepalive", "stalled_reader")
REFUSAL_KINDS = ("reading_full", "buffered_full", "header_too_large")


def http_response(error: ServiceError) -> bytes:
    """A whole ``Connection: close`` response with the JSON error body, for answers written below Tornado's
    request handling (no handler exists yet)."""
    body = dumps(error_body(error)).encode()
    reason = http.client.responses.get(error.status, "Error")
    head = (f"HTTP/1.1 {error.status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + body


@dataclass(slots=True, eq=False)
class Connection:
    stream: tornado.iostream.IOStream
    client: str
    opened: float
    idle_since: float  # when the server began to wait for this connection's next request head
    head_started: float | None = None  # when bytes of that head were first seen
    requests: int = 0  # requests begun on it
    busy: bool = False  # a request is being handled (head in, response not finished)


class ConnectionTracker:
    """Open connections, their timeouts, and the reading bound; runs on the event loop thread."""

    def __init__(self, settings: ServerSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._conns: dict[int, Connection] = {}
        self._sweeper: tornado.ioloop.PeriodicCallback | None = None
        self.reading = 0  # requests reading their body
        self.buffered_bytes = 0  # body bytes held by requests reading or parsing their body
        self.timeouts: collections.Counter[str] = collections.Counter({kind: 0 for kind in TIMEOUT_KINDS})
        self.refused: collections.Counter[str] = collections.Counter({kind: 0 for kind in REFUSAL_KINDS})

    # --- connections -----------------------------------------------------------------------------

    @property
    def open_connections(self) -> int:
        return sum(1 for conn in self._conns.values() if not conn.stream.closed())

    def open(self, stream: tornado.iostream.IOStream, address: Any) -> None:
        """A client connected (``TrackedHTTPServer.handle_stream``)."""
        now = self._clock()
        client = address[0] if isinstance(address, tuple) and address else str(address)
        conn = Connection(stream, client, opened=now, idle_since=now)
        self._conns[id(stream)] = conn
        self._answer_oversized_heads(conn)
        if self._sweeper is None:
            self._sweeper = tornado.ioloop.PeriodicCallback(self.sweep, SWEEP_SECONDS * 1000)
            self._sweeper.start()

    def request_started(self, stream: Any) -> None:
        conn = self._conns.get(id(stream))
        if conn is not None:
            conn.busy, conn.head_started = True, None
            conn.requests += 1

    def request_ended(self, stream: Any) -> None:
        conn = self._conns.get(id(stream))
        if conn is not None and conn.busy:
            conn.busy, conn.idle_since = False, self._clock()

    def sweep(self) -> None:
        """Forget closed connections; close those past ``headerTimeout`` or ``keepAliveTimeout``."""
        now = self._clock()
        for key, conn in list(self._conns.items()):
            if conn.stream.closed():
                del self._conns[key]
            elif not conn.busy:
                self._check_idle(conn, now)

    def _check_idle(self, conn: Connection, now: float) -> None:
        s = self.settings
        if _buffered(conn.stream):  # part of a head is in: it has headerTimeout from its first byte
            if conn.head_started is None:
                conn.head_started = conn.idle_since if conn.requests == 0 else now
            if now - conn.head_started > s.header_timeout:
                self._expire(conn, "header", f"request head not complete within headerTimeout ({s.header_timeout:g} s)",
                             answer=True)
        elif conn.requests == 0 and now - conn.idle_since > s.header_timeout:
            self._expire(conn, "header", f"no request head within headerTimeout ({s.header_timeout:g} s)")
        elif conn.requests > 0 and now - conn.idle_since > s.keep_alive_timeout:
            self._expire(conn, "keepalive", f"idle past keepAliveTimeout ({s.keep_alive_timeout:g} s)")

    def _expire(self, conn: Connection, kind: str, why: str, *, answer: bool = False) -> None:
        self.timeouts[kind] += 1
        status = 408 if kind == "header" else None
        self.log_outcome(conn.client, status, f"{kind}_timeout" if kind == "header" else "idle_closed", why)
        stream = conn.stream
        if answer:
            message = f"{why}; closing the connection"
            payload = http_response(RequestTimeout(message))
            try:
                stream.write(payload).add_done_callback(lambda _: stream.close())
            except tornado.iostream.StreamClosedError:
                return
            tornado.ioloop.IOLoop.current().call_later(1.0, stream.close)  # the write may never drain
        else:
            stream.close()

    def log_outcome(self, client: str, status: int | None, event: str, detail: str) -> None:
        """An access-log line for a connection that ended without a request being answered."""
        log.info(format_fields({"event": event, "status": status, "client": client, "detail": detail}))

    # --- 431: a head over maxHeaderBytes ------------------------------------------------------------

    def _answer_oversized_heads(self, conn: Connection) -> None:
        """Tornado closes a connection whose head outgrows ``max_header_size``; answer 431 first.

        Its stream is closed with ``UnsatisfiableReadError``: the close is wrapped to write the 431, then
        (plain TCP) keep reading and dropping what the client still sends for a moment, so that the
        client reads the answer rather than a reset."""
        stream, tracker = conn.stream, self
        close = stream.close

        def close_answering_431(exc_info: Any = False) -> None:
            error = exc_info[1] if isinstance(exc_info, tuple) else (sys.exc_info()[1] if exc_info is True
                                                                     else exc_info)
            if isinstance(error, tornado.iostream.UnsatisfiableReadError) and not conn.busy and not stream.closed():
                tracker.refused["header_too_large"] += 1
                limit = tracker.settings.max_header_bytes
                message = f"request head is larger than maxHeaderBytes ({limit} bytes)"
                tracker.log_outcome(conn.client, 431, "header_too_large", message)
                payload = http_response(HeaderTooLarge(message))
                if isinstance(stream, tornado.iostream.SSLIOStream):
                    stream.write(payload)  # best effort: TLS cannot outlive the stream
                else:
                    _reply_and_linger(stream.socket, payload)
            close(exc_info)

        stream.close = close_answering_431  # type: ignore[method-assign]

    # --- the reading bound ---------------------------------------------------------------------------

    def start_reading(self) -> bool:
        """A request starts reading its body: False (refuse it) when ``maxReadingRequests`` are already."""
        if self.reading >= self.settings.max_reading_requests:
            self.refused["reading_full"] += 1
            return False
        self.reading += 1
        return True

    def add_body_bytes(self, n: int) -> bool:
        """``n`` more body bytes held: False (refuse that request) past ``maxBufferedBodyMB`` in all."""
        if self.buffered_bytes + n > self.settings.max_buffered_body_bytes:
            self.refused["buffered_full"] += 1
            return False
        self.buffered_bytes += n
        return True

    def release_body_bytes(self, n: int) -> None:
        """A body's bytes are freed: parsed, refused, or its client gone."""
        self.buffered_bytes -= n

    def stop_reading(self) -> None:
        self.reading -= 1

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None


def _buffered(stream: tornado.iostream.IOStream) -> int:
    """Bytes read from the client and not yet consumed: a request head in progress."""
    return getattr(stream, "_read_buffer_size", 0)


def _reply_and_linger(sock: socket.socket, payload: bytes) -> None:
    """Send ``payload`` on a duplicate of ``sock`` (Tornado closes the original), shut the writing side,
    and read and drop input for up to ``LINGER_SECONDS`` / ``LINGER_BYTES`` before closing."""
    try:
        dup = sock.dup()
        dup.setblocking(False)
        dup.send(payload)
        dup.shutdown(socket.SHUT_WR)
    except OSError:
        return
    loop = tornado.ioloop.IOLoop.current()
    fd = dup.fileno()
    drained = 0

    def finish() -> None:
        if dup.fileno() < 0:
            return
        loop.remove_handler(fd)
        loop.remove_timeout(timer)
        dup.close()

    def on_readable(_fd: int, _events: int) -> None:
        nonlocal drained
        try:
            data = dup.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        drained += len(data)
        if not data or drained > LINGER_BYTES:
            finish()

    timer = loop.call_later(LINGER_SECONDS, finish)
    loop.add_handler(fd, on_readable, tornado.ioloop.IOLoop.READ)


class TrackedHTTPServer(tornado.httpserver.HTTPServer):
    """An ``HTTPServer`` that hands each new connection to a ``ConnectionTracker``."""

    tracker: ConnectionTracker

    def handle_stream(self, stream: tornado.iostream.IOStream, address: tuple) -> None:
        self.tracker.open(stream, address)
        super().handle_stream(stream, address)


def start_http_server(app: tornado.web.Application, sockets: Iterable[socket.socket], *,
                      ssl_options: Any = None) -> TrackedHTTPServer:
    """Serve ``app`` (from ``make_app``) on ``sockets`` with the connection limits of its settings."""
    ctx = app.settings["mindserve_context"]
    s: ServerSettings = ctx.settings
    server = TrackedHTTPServer(
        app, ssl_options=ssl_options, max_header_size=s.max_header_bytes,
        max_body_size=s.max_request_bytes + (1 << 20),  # JsonBodyHandler answers 413 itself below this
        idle_connection_timeout=max(s.header_timeout, s.keep_alive_timeout) + BACKSTOP_SECONDS,
        body_timeout=s.body_timeout + BACKSTOP_SECONDS)
    server.tracker = ctx.connections
    server.add_sockets(sockets)
    return server


def bind(port: int, address: str, settings: ServerSettings) -> list[socket.socket]:
    """Listening sockets for ``address:port`` with the configured ``listenBacklog``."""
    return tornado.netutil.bind_sockets(port, address, backlog=settings.listen_backlog)
