"""Remote media: only from a whitelisted host, only from public addresses, and the connection goes to the
addresses that were checked (a resolver pinned to them: no second lookup, no DNS rebinding). One GET, no
redirects, no content coding; connect ``connect_timeout``, no byte for ``read_idle_timeout``, the whole
fetch ``fetch_timeout``; the body streamed and cut at its limit. All on the event loop."""
from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from concurrent.futures import Executor
from typing import Any
from urllib.parse import quote, urlsplit

import tornado.netutil
from tornado import httputil
from tornado.http1connection import HTTP1Connection, HTTP1ConnectionParameters
from tornado.iostream import IOStream, StreamClosedError
from tornado.tcpclient import TCPClient

from service.media.addresses import refusal
from service.media.errors import DownloadFailed, OverLimit
from service.media.parts import MediaRef
from service.media.policy import DOMAINS_ENV, MediaPolicy

CHUNK = 64 * 1024
MAX_HEADER_BYTES = 64 * 1024
USER_AGENT = "mindserve-media"
_TARGET_SAFE = "/?&=%:@!$'()*+,;~-._"  # what stays as it is in the request target; the rest is %-encoded


def host_of(ref: MediaRef) -> str:
    return urlsplit(ref.url).hostname or ""


def check_host(ref: MediaRef, policy: MediaPolicy) -> None:
    """The whitelist: the URL's host must be one of ``policy.domains`` (exact, case-insensitive)."""
    host = host_of(ref)
    if not policy.domains:
        raise ref.refused(f"remote media are disabled on this server: {DOMAINS_ENV} lists no host")
    if host not in policy.domains:
        raise ref.refused(f"host {host} is not on this server's media whitelist ({DOMAINS_ENV})")


class PinnedResolver(tornado.netutil.Resolver):
    """Answers every lookup with the addresses already checked."""

    def initialize(self, addresses: list[tuple[int, Any]]) -> None:  # type: ignore[override]
        self.addresses = addresses

    async def resolve(self, host: str, port: int, family: socket.AddressFamily = socket.AF_UNSPEC
                      ) -> list[tuple[int, Any]]:
        return self.addresses


class SystemResolver(tornado.netutil.Resolver):
    """The system's ``getaddrinfo`` on an executor of its own: a slow lookup waits there, never in the
    event loop's default executor (which the generation routes use)."""

    def initialize(self, executor: Executor) -> None:  # type: ignore[override]
        self.executor = executor

    async def resolve(self, host: str, port: int, family: socket.AddressFamily = socket.AF_UNSPEC
                      ) -> list[tuple[int, Any]]:
        infos = await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(socket.getaddrinfo, host, port, family, socket.SOCK_STREAM))
        return [(af, sockaddr) for af, _, _, _, sockaddr in infos]


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


async def fetch(ref: MediaRef, policy: MediaPolicy, limit: int, deadline: float,
                resolver: tornado.netutil.Resolver) -> bytes:
    """The body of ``ref``'s URL by ``deadline`` (loop time), its host looked up with ``resolver``;
    ``OverLimit`` past ``limit`` bytes, ``DownloadFailed`` naming the host, ``MediaRefused`` for an address
    that is not public."""
    parts, loop = urlsplit(ref.url), asyncio.get_running_loop()
    host, https = parts.hostname or "", parts.scheme.lower() == "https"
    port = parts.port or (443 if https else 80)
    addresses = await _vetted(ref, policy, resolver, host, port, deadline)
    try:
        stream = await TCPClient(resolver=PinnedResolver(addresses=addresses)).connect(
            host, port, ssl_options=_tls() if https else None,
            timeout=min(policy.connect_timeout, deadline - loop.time()))
    except asyncio.TimeoutError:
        raise DownloadFailed(ref.field, ref.url, host,
                             f"could not connect within {policy.connect_timeout:g} s") from None
    except ssl.SSLError as exc:
        raise DownloadFailed(ref.field, ref.url, host, f"TLS failed: {exc.reason or exc}") from None
    except (OSError, ValueError, StreamClosedError) as exc:
        raise DownloadFailed(ref.field, ref.url, host, f"could not connect: {_os_reason(exc)}") from None
    try:
        return await _get(ref, policy, stream, parts, limit, deadline)
    finally:
        stream.close()


async def _vetted(ref: MediaRef, policy: MediaPolicy, resolver: tornado.netutil.Resolver, host: str, port: int,
                  deadline: float) -> list[tuple[int, Any]]:
    """Every address ``host`` resolves to, each one public (else the part is refused)."""
    try:
        addresses = await asyncio.wait_for(resolver.resolve(host, port, socket.AF_UNSPEC),
                                           deadline - asyncio.get_running_loop().time())
    except asyncio.TimeoutError:
        raise DownloadFailed(ref.field, ref.url, host, "its name did not resolve in time") from None
    except (OSError, ValueError) as exc:  # ValueError: a name getaddrinfo cannot encode (a label over 63)
        raise DownloadFailed(ref.field, ref.url, host, f"its name does not resolve: {_os_reason(exc)}") from None
    if not addresses:
        raise DownloadFailed(ref.field, ref.url, host, "its name resolves to no address")
    for _, sockaddr in addresses:
        why = refusal(sockaddr[0], allow_loopback=policy.allow_loopback_for_tests)
        if why is not None:
            raise ref.refused(f"host {host} resolves to {why}; remote media are fetched from public addresses only")
    return addresses


async def _get(ref: MediaRef, policy: MediaPolicy, stream: IOStream, parts: Any, limit: int,
               deadline: float) -> bytes:
    conn = HTTP1Connection(stream, True, HTTP1ConnectionParameters(
        no_keep_alive=True, max_header_size=MAX_HEADER_BYTES, max_body_size=limit + 2 * CHUNK, chunk_size=CHUNK,
        decompress=False))
    target = quote(parts.path or "/", safe=_TARGET_SAFE) + (f"?{quote(parts.query, safe=_TARGET_SAFE)}"
                                                            if parts.query else "")
    conn.write_headers(httputil.RequestStartLine("GET", target, "HTTP/1.1"), httputil.HTTPHeaders({
        "Host": parts.netloc, "User-Agent": USER_AGENT, "Accept-Encoding": "identity", "Connection": "close"}))
    conn.finish()
    body = _Body(stream, limit)
    timed_out = await _read_watched(conn, body, policy, stream, deadline)
    host = parts.hostname
    if body.over is not None:
        raise body.over
    if body.error is not None:
        raise DownloadFailed(ref.field, ref.url, host, body.error)
    if timed_out is not None:
        raise DownloadFailed(ref.field, ref.url, host, timed_out)
    if not body.complete:
        raise DownloadFailed(ref.field, ref.url, host, "its response ended early or was not valid HTTP")
    return b"".join(body.chunks)


async def _read_watched(conn: HTTP1Connection, body: _Body, policy: MediaPolicy, stream: IOStream,
                        deadline: float) -> str | None:
    """Read the response; close the stream when no byte came for ``read_idle_timeout`` or the fetch's
    deadline passed (returning why), or when this task is cancelled (the client left)."""
    loop = asyncio.get_running_loop()
    reading = asyncio.ensure_future(conn.read_response(body))
    timed_out, window = None, deadline - loop.time()
    try:
        while not reading.done():
            idle_end = body.last + policy.read_idle_timeout
            now = loop.time()
            if now >= min(idle_end, deadline):
                timed_out = (f"no data for {policy.read_idle_timeout:g} s" if idle_end < deadline
                             else f"not complete in time (it had {window:.3g} s left of the request's "
                                  f"{policy.fetch_timeout:g} s for media)")
                stream.close()
                break
            await asyncio.wait({reading}, timeout=min(idle_end, deadline) - now)
        try:
            await reading
        except StreamClosedError:
            pass  # closed by us (a refusal, a timeout) or by the host: ``body`` says which
        except Exception as exc:  # noqa: BLE001 - a response Tornado cannot read (e.g. a header over the cap)
            body.error = body.error or f"its response could not be read: {_os_reason(exc)}"
    finally:
        stream.close()
        if not reading.done():
            reading.cancel()
    return timed_out


class _Body(httputil.HTTPMessageDelegate):
    """Collects a 200 response's body up to ``limit`` bytes; anything else closes the stream and says why
    (never raising: Tornado would log a traceback for an exception here)."""

    def __init__(self, stream: IOStream, limit: int) -> None:
        self.stream, self.limit = stream, limit
        self.chunks: list[bytes] = []
        self.size = 0
        self.error: str | None = None
        self.over: OverLimit | None = None
        self.complete = False
        self.last = asyncio.get_running_loop().time()

    def _stop(self) -> None:
        self.stream.close()

    def headers_received(self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
                         headers: httputil.HTTPHeaders) -> None:
        self.last = asyncio.get_running_loop().time()
        code, reason = start_line.code, start_line.reason  # type: ignore[union-attr]
        if 300 <= code < 400:
            self.error = (f"it answered {code} {reason}, a redirect to {headers.get('Location', 'nowhere')[:200]}; "
                          f"redirects are not followed")
        elif code != 200:
            self.error = f"it answered {code} {reason}"
        elif headers.get("Content-Encoding", "identity").lower() != "identity":
            self.error = f"it sent Content-Encoding {headers['Content-Encoding'][:50]}; only identity is accepted"
        elif _declared(headers) is not None and _declared(headers) > self.limit:
            self.over = OverLimit(_declared(headers), declared=True)
        else:
            return
        self._stop()

    def data_received(self, chunk: bytes) -> None:
        if self.error is not None or self.over is not None:
            return
        self.last = asyncio.get_running_loop().time()
        self.size += len(chunk)
        if self.size > self.limit:
            self.over = OverLimit(self.size)
            self.chunks.clear()
            self._stop()
            return
        self.chunks.append(chunk)

    def finish(self) -> None:
        self.complete = self.error is None and self.over is None

    def on_connection_close(self) -> None:
        pass


def _declared(headers: httputil.HTTPHeaders) -> int | None:
    try:
        return int(headers["Content-Length"])
    except (KeyError, ValueError):
        return None


def _os_reason(exc: BaseException) -> str:
    exc = getattr(exc, "real_error", None) or exc  # a StreamClosedError carries the socket's error
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
