"""``make_app``: the only constructor of the Tornado application (the CLI and the tests call it), and its routes."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tornado.web

from backends.base import Backend
from backends.settings import LoraSettings
from service.access_log import log_request
from service.admission import Admission
from service.config import BUSINESS, MANAGEMENT, METRICS, ServerSettings
from service.connections import ConnectionTracker
from service.context import AppContext, RequestLimits
from service.dialects.anthropic import MESSAGES, MessagesHandler
from service.dialects.anthropic_count import CountTokensHandler
from service.dialects.openai import CHAT, COMPLETIONS
from service.dialects.openai_responses import RESPONSES
from service.dialects.tgi import Route as TGIRoute
from service.dialects.tgi import TGIDialect
from service.http import NotFoundHandler
from service.lora_admin import lora_admin_routes
from service.media.loader import MediaLoader
from service.media.policy import MediaPolicy
from service.metrics import ServiceMetrics
from service.models import ModelRegistry
from service.ops_handlers import (HealthHandler, InfoHandler, LiveHandler, LoadsHandler, MetricsHandler,
                                  ModelHandler, ModelsHandler, OpenAPIHandler, TokenizerHandler)
from service.pipeline import GenerationHandler
from service.playground import playground_routes
from service.root import root_routes
from service.state import ServerState
from service.tokenize import DetokenizeHandler, TokenizeHandler
from service.validation import Schemas, default_schemas

ALL_PLANES = frozenset({BUSINESS, MANAGEMENT, METRICS})
Route = tuple[str, type[tornado.web.RequestHandler], dict[str, Any]]


def business_routes(ctx: AppContext) -> list[Route]:
    """Generation (the TGI, OpenAI and Anthropic dialects), tokenizer, model list, OpenAPI, the playground page: served
    on ``port``."""
    args = {"ctx": ctx}
    generation = [(path, {"ctx": ctx, "dialect": dialect}) for path, dialect in (
        (r"/", TGIDialect(TGIRoute.ROOT)),
        (r"/generate", TGIDialect(TGIRoute.OBJECT)),
        (r"/generate_stream", TGIDialect(TGIRoute.STREAM)),
        (r"/v1/completions", COMPLETIONS),
        (r"/v1/chat/completions", CHAT),
        (r"/v1/responses", RESPONSES),
    )]
    return [
        *playground_routes(ctx),  # first: a browser's GET / is matched before POST /'s route
        *root_routes(ctx),  # then any other GET / or HEAD /
        *((path, GenerationHandler, kwargs) for path, kwargs in generation),
        (r"/v1/messages", MessagesHandler, {"ctx": ctx, "dialect": MESSAGES}),
        (r"/v1/messages/count_tokens", CountTokensHandler, args),
        (r"/v1/tokenizer", TokenizerHandler, args),
        (r"/tokenize", TokenizeHandler, args),
        (r"/detokenize", DetokenizeHandler, args),
        (r"/v1/models", ModelsHandler, args),
        (r"/v1/models/(.+)", ModelHandler, args),
        (r"/v1/loads", LoadsHandler, args),  # for a gateway: SGLang's load shape (service/loads.py)
        (r"/openapi\.json", OpenAPIHandler, args),
    ]


def management_routes(ctx: AppContext) -> list[Route]:
    """Health and /info: served on ``managementPort`` when it differs from ``port``."""
    args = {"ctx": ctx}
    return [
        (r"/health", HealthHandler, args),
        (r"/v2/health/live", LiveHandler, args),
        (r"/v2/health/ready", HealthHandler, args),
        (r"/info", InfoHandler, args),
        *lora_admin_routes(ctx),
    ]


def metrics_routes(ctx: AppContext) -> list[Route]:
    """Prometheus ``/metrics``: served on ``metricsPort`` when it differs from ``port``."""
    return [(r"/metrics", MetricsHandler, {"ctx": ctx})]


_PLANE_ROUTES = {BUSINESS: business_routes, MANAGEMENT: management_routes, METRICS: metrics_routes}


def make_app(backend: Backend, settings: ServerSettings = ServerSettings(), *,
             schemas: Schemas | None = None, limits: RequestLimits = RequestLimits(),
             state: ServerState | None = None, metrics: ServiceMetrics | None = None,
             admission: Admission | None = None, connections: ConnectionTracker | None = None,
             media: MediaLoader | MediaPolicy | None = None,
             planes: Iterable[str] = ALL_PLANES, lora: LoraSettings = LoraSettings(),
             models: ModelRegistry | None = None) -> tornado.web.Application:
    """One app serving ``planes``. The apps of one process share ``state``, ``metrics``, ``admission`` and
    ``connections``; without a ``state`` the app is ready at once (the backend handed in is already loaded
    and warmed up); without an ``admission`` the app gets its own (``maxLinkNum`` in flight, twice that
    waiting). ``media``: the apps' media loader (shared like ``admission``), or a policy to build one from;
    without, the policy of ``settings`` with no remote host allowed. ``models``: every served model, ``backend``
    the first's (without: ``backend`` alone). Serve it with
    ``service.connections.start_http_server``."""
    planes = frozenset(planes)
    if not planes or planes - ALL_PLANES:
        raise ValueError(f"planes must be a non-empty subset of {sorted(ALL_PLANES)}, got {sorted(planes)}")
    models = models or ModelRegistry.of_backend(backend)
    metrics = metrics or ServiceMetrics.for_models(models)
    admission = admission or Admission(settings.max_link_num)
    connections = connections or ConnectionTracker(settings)
    metrics.watch_http(admission, connections)
    if not isinstance(media, MediaLoader):
        media = MediaLoader(media or MediaPolicy.from_settings(settings))
    ctx = AppContext(backend, settings, schemas or default_schemas(), limits, state or ServerState(ready=True),
                     metrics, admission, connections, media, lora, models=models)
    routes = [route for plane in (BUSINESS, MANAGEMENT, METRICS) if plane in planes
              for route in _PLANE_ROUTES[plane](ctx)]
    return tornado.web.Application(routes, default_handler_class=NotFoundHandler,
                                   default_handler_args={"ctx": ctx}, log_function=log_request,
                                   mindserve_context=ctx)
