"""The playground: a browser page for ``POST /`` (and, in its chat mode, ``/v1/chat/completions``), served from
the package's ``static/`` files.

``GET /playground`` always, and ``GET /`` when the client asks for HTML (a browser); any other ``GET /`` keeps
its 405. ``ServerConfig.playgroundEnabled: false`` serves none of it. The page builds its form from
``/openapi.json`` at run time and calls only relative URLs, so it works over HTTPS, with the management plane
on another port and behind a proxy that adds a path prefix.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib.abc import Traversable
from typing import Any

import tornado.httputil
import tornado.routing

from service.context import AppContext
from service.errors import NotFound
from service.http import GetHandler
from service.package_data import STATIC_DIR

PAGE = "playground.html"
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
_HTML_TYPES = ("text/html", "application/xhtml+xml")
# The page loads nothing from elsewhere and talks only to its own origin.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str


@functools.cache
def load_assets(static_dir: Traversable = STATIC_DIR) -> dict[str, Asset]:
    """Every file of ``static_dir`` by name, read once (a few kB)."""
    assets = {}
    for entry in static_dir.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _TYPES:
            assets[entry.name] = Asset(entry.read_bytes(), _TYPES[suffix])
    if PAGE not in assets:
        raise FileNotFoundError(f"{static_dir}: the playground page {PAGE} is missing from the package")
    return assets


def wants_html(accept: str | None) -> bool:
    """Whether an ``Accept`` header asks for HTML: text/html (or XHTML) named with q > 0 and ranked above
    application/json. ``*/*`` alone (curl, requests, the HF client) is not a request for HTML."""
    html = json = 0.0
    for media_range in (accept or "").split(","):
        kind, *params = (part.strip() for part in media_range.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        kind = kind.lower()
        if kind in _HTML_TYPES:
            html = max(html, q)
        elif kind == "application/json":
            json = max(json, q)
    return html > 0 and html > json


class BrowserRoot(tornado.routing.PathMatches):
    """``/`` for a GET or HEAD that asks for HTML; everything else at ``/`` falls through to ``POST /``'s
    route."""

    def __init__(self) -> None:
        super().__init__(r"/")

    def match(self, request: tornado.httputil.HTTPServerRequest) -> dict[str, Any] | None:
        if request.method not in ("GET", "HEAD") or not wants_html(request.headers.get("Accept")):
            return None
        return super().match(request)


class PlaygroundHandler(GetHandler):
    """The page (no ``asset``) or one of its files."""

    public = True  # open without the API key (service/auth.py)

    def initialize(self, ctx: AppContext, assets: dict[str, Asset]) -> None:  # type: ignore[override]
        super().initialize(ctx)
        self.assets = assets

    def get(self, asset: str = PAGE) -> None:
        found = self.assets.get(asset)
        if found is None:
            raise NotFound(f"no playground file {asset!r} (files: {', '.join(sorted(self.assets))})")
        self.set_header("Content-Type", found.content_type)
        self.set_header("Cache-Control", "no-cache")  # revalidated by ETag: a new version shows at once
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Content-Security-Policy", _CSP)
        self.set_header("Vary", "Accept")
        self.write(found.body)


def playground_routes(ctx: AppContext) -> list[Any]:
    """The playground's routes on the business plane (none when ``playgroundEnabled`` is false); the
    browser's ``GET /`` comes before ``POST /``'s route, which keeps every other request to ``/``."""
    if not ctx.settings.playground_enabled:
        return []
    args = {"ctx": ctx, "assets": load_assets()}
    return [
        tornado.routing.Rule(BrowserRoot(), PlaygroundHandler, args),
        (r"/playground", PlaygroundHandler, args),
        (r"/playground/(?P<asset>[A-Za-z0-9_-]+\.[a-z]+)", PlaygroundHandler, args),
    ]
