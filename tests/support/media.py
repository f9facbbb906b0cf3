"""Media for the tests: small real images, a decompression bomb, a resolver that maps test names to any
address, and a media HTTP server on 127.0.0.1 whose routes misbehave in the ways a remote host can."""
from __future__ import annotations

import asyncio
import io
import socket
import struct
import zlib
from typing import Any

import tornado.iostream
import tornado.netutil
import tornado.web
from PIL import Image


def png(width: int = 8, height: int = 6, color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(width: int = 16, height: int = 12) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 120, 240)).save(buf, format="JPEG")
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG header for ``width`` x ``height`` 8-bit grey pixels with a tiny IDAT: a few hundred
    bytes that would expand to width*height bytes if decoded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\x00" * 1024, 9)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", rows) + _chunk(b"IEND", b"")


def mp4_header() -> bytes:
    return b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00" * 64


class MappedResolver(tornado.netutil.Resolver):
    """Resolves the names in ``table`` (name -> list of IP literals) and IP literals; nothing else."""

    def initialize(self, table: dict[str, list[str]]) -> None:  # type: ignore[override]
        self.table = table

    async def resolve(self, host: str, port: int, family: socket.AddressFamily = socket.AF_UNSPEC
                      ) -> list[tuple[int, Any]]:
        addresses = self.table.get(host.lower(), [host] if tornado.netutil.is_valid_ip(host) else None)
        if addresses is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6, (a, port, 0, 0)) if ":" in a else (socket.AF_INET, (a, port)) for a in addresses]


class MediaSite:
    """What the media HTTP server did: per route, the bytes it managed to write and whether the client
    closed the connection on it."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.cut: dict[str, bool] = {}
        self.image = png()


class _Route(tornado.web.RequestHandler):
    def initialize(self, site: MediaSite) -> None:  # type: ignore[override]
        self.site = site

    async def _stream(self, name: str, chunks: int, chunk: bytes, pause: float = 0.0) -> None:
        self.site.sent[name], self.site.cut[name] = 0, False
        try:
            for _ in range(chunks):
                self.write(chunk)
                await self.flush()
                self.site.sent[name] += len(chunk)
                if pause:
                    await asyncio.sleep(pause)
        except tornado.iostream.StreamClosedError:
            self.site.cut[name] = True


class OkImage(_Route):
    def get(self) -> None:
        self.set_header("Content-Type", "image/png")
        self.write(self.site.image)


class NotAnImage(_Route):
    def get(self) -> None:
        self.write(b"this is not a PNG at all" * 10)


class Redirect(_Route):
    def get(self) -> None:
        self.redirect("http://169.254.169.254/latest/meta-data/a.png", status=302)


class Missing(_Route):
    def get(self) -> None:
        self.set_status(404)
        self.write("no such image")


class Gzipped(_Route):
    def get(self) -> None:
        self.set_header("Content-Encoding", "gzip")
        self.write(zlib.compress(self.site.image))


class Endless(_Route):
    """A chunked body with no end in sight (16 MiB, 64 KiB at a time)."""

    async def get(self) -> None:
        await self._stream("endless", 256, b"\x89" * 65536)


class Declared(_Route):
    """Declares a huge Content-Length, then sends a little."""

    def get(self) -> None:
        self._auto_finish = False  # the response is written by hand, below Tornado's own framing
        self.request.connection.stream.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\nxx")
        self.site.sent["declared"] = 2


class Raw(_Route):
    """Writes ``RAW[name]`` as the whole response, below Tornado's own framing."""

    RAW = {"garbage": b"SPDY/9 what\r\n\r\n", "header": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
           "short": b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\nonly this"}

    def get(self, name: str) -> None:
        self._auto_finish = False
        stream = self.request.connection.stream
        stream.write(self.RAW[name]).add_done_callback(lambda _: stream.close())


class Stalled(_Route):
    """Headers and a first byte, then silence."""

    async def get(self) -> None:
        self.set_header("Content-Length", "1000")
        await self._stream("stalled", 1, b"x")
        await asyncio.sleep(5)


class Trickle(_Route):
    """A byte every 0.1 s: never idle, never done."""

    async def get(self) -> None:
        await self._stream("trickle", 100, b"x", pause=0.1)


class Silent(_Route):
    """Never answers."""

    async def get(self) -> None:
        await asyncio.sleep(5)


def media_app(site: MediaSite) -> tornado.web.Application:
    args = {"site": site}
    return tornado.web.Application([
        (r"/ok\.png", OkImage, args), (r"/text\.png", NotAnImage, args), (r"/redirect\.png", Redirect, args),
        (r"/missing\.png", Missing, args), (r"/gzip\.png", Gzipped, args), (r"/endless\.png", Endless, args),
        (r"/declared\.png", Declared, args), (r"/stalled\.png", Stalled, args), (r"/trickle\.png", Trickle, args),
        (r"/silent\.png", Silent, args), (r"/raw-(\w+)\.png", Raw, args),
    ])


def start_media_site(live_servers) -> tuple[MediaSite, int]:
    """A MediaSite served on 127.0.0.1:<free port> by the live servers' loop (tests/e2e/conftest.py), stopped
    with them; (the site, its port)."""
    from tornado.httpserver import HTTPServer

    site = MediaSite()

    async def bind() -> int:
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        server = HTTPServer(media_app(site))
        server.add_sockets(sockets)
        live_servers.servers.append(server)
        return sockets[0].getsockname()[1]

    return site, asyncio.run_coroutine_threadsafe(bind(), live_servers.loop).result(30)
