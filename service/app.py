"""``make_app``: the only constructor of the Tornado application (the CLI and the tests call it)."""
from __future__ import annotations

from dataclasses import dataclass

import tornado.web

from backends.base import Backend
from service.config import ServerSettings
from service.handlers import GenerateHandler, HealthHandler, NotFoundHandler
from service.protocol import RequestLimits
from service.validation import Schemas, default_schemas


@dataclass(frozen=True, slots=True)
class AppContext:
    """Collaborators every handler gets through ``initialize``."""

    backend: Backend
    settings: ServerSettings
    schemas: Schemas
    limits: RequestLimits


def make_app(backend: Backend, settings: ServerSettings = ServerSettings(), *,
             schemas: Schemas | None = None, limits: RequestLimits = RequestLimits()) -> tornado.web.Application:
    ctx = AppContext(backend, settings, schemas or default_schemas(), limits)
    routes = [
        (r"/", GenerateHandler, {"ctx": ctx}),
        (r"/health", HealthHandler, {"ctx": ctx}),
    ]
    return tornado.web.Application(routes, default_handler_class=NotFoundHandler,
                                   default_handler_args={"ctx": ctx})
