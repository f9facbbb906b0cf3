"""What ``/`` answers besides ``POST /`` (generation, ``service/pipeline.py``): a browser's ``GET /`` gets the
playground page (``service/playground.py`` routes it first); any other ``GET`` or ``HEAD /`` (curl, a probe,
a fuzzer following the OpenAPI document) gets a small JSON document pointing at the interface's
description (``schemas/root_response.schema.json``), not a 405."""
from __future__ import annotations

from typing import Any

import tornado.httputil
import tornado.routing

from service.context import AppContext
from service.http import GetHandler
from service.info import version

OPENAPI = "/openapi.json"
DOCS = "docs/api.md in mindserve's source; the OpenAPI document at /openapi.json"
GENERATE = "POST / (TGI 0.9.4), /generate, /generate_stream, /v1/completions, /v1/chat/completions"


class RootGet(tornado.routing.PathMatches):
    """A GET or HEAD of ``/`` (after the playground's browser rule); POST and the rest go to ``POST /``'s
    route."""

    def __init__(self) -> None:
        super().__init__(r"/")

    def match(self, request: tornado.httputil.HTTPServerRequest) -> dict[str, Any] | None:
        return super().match(request) if request.method in ("GET", "HEAD") else None


class RootHandler(GetHandler):
    public = True  # open without the API key (service/auth.py)

    def get(self) -> None:
        self.write_json(root_document(self.ctx.backend.model_name, self.ctx.settings.playground_enabled))


def root_document(model: str, playground: bool) -> dict[str, Any]:
    return {"name": "mindserve", "version": version(), "model": model, "generate": GENERATE, "openapi": OPENAPI,
            "docs": DOCS, "playground": "/playground" if playground else None}


def root_routes(ctx: AppContext) -> list[Any]:
    return [tornado.routing.Rule(RootGet(), RootHandler, {"ctx": ctx})]
