"""Operations routes: health and readiness, ``/info``, ``/v1/tokenizer``, ``/v1/models``, ``/metrics``,
``/openapi.json``. Generation lives in ``pipeline.py`` and ``dialects/``; the route tables are in ``app.py``.
"""
from __future__ import annotations

import asyncio

from backends.errors import BackendError
from service.errors import NotFound, ServiceUnavailable, from_backend_error
from service.http import GetHandler, JsonBodyHandler
from service.info import adapter_card, model_card, model_list, server_info
from service.loads import worker_loads
from service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.openapi import Served, build_openapi


class _EmptyOkHandler(GetHandler):
    public = True

    def ok(self) -> None:
        """200 with an empty body (no Content-Type), as TGI's ``/health``."""
        self.clear_header("Content-Type")
        self.set_status(200)


class HealthHandler(_EmptyOkHandler):
    """``GET /health`` and ``GET /v2/health/ready``: 200 once warmed up, 503 before that and while draining."""

    def get(self) -> None:
        if not self.ctx.state.ready:
            raise ServiceUnavailable(self.ctx.state.describe())
        self.ok()


class LiveHandler(_EmptyOkHandler):
    """``GET /v2/health/live``: 200 whenever the process answers HTTP at all."""

    def get(self) -> None:
        self.ok()


class InfoHandler(GetHandler):
    public = True

    def get(self) -> None:
        self.write_json(server_info(self.ctx))


class TokenizerHandler(JsonBodyHandler):
    """``POST /v1/tokenizer``: ``{"inputs": str}`` → ``{"token_number": n, "tokens": [ids]}``."""

    async def post(self) -> None:
        body = self.json_body()
        self.ctx.schemas.validate("tokenizer_request", body)
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(None, self.ctx.backend.tokenize, body["inputs"])
        except BackendError as exc:  # 503 while the model loads
            raise from_backend_error(exc) from None
        self.write_json({"token_number": len(ids), "tokens": ids})


class ModelsHandler(GetHandler):
    openai_401 = True

    def get(self) -> None:
        self.write_json(model_list(self.ctx))


class ModelHandler(GetHandler):
    openai_401 = True

    def get(self, model_id: str) -> None:
        if model_id in self.ctx.models.names:
            self.write_json(model_card(self.ctx, model_id))
            return
        slot, adapter = next(((s, a) for s in self.ctx.models.slots for a in s.backend.adapters()
                              if a["name"] == model_id), (None, None))
        if adapter is None:
            adapters = sum(len(s.backend.adapters()) for s in self.ctx.models.slots)
            raise NotFound(f"model {model_id!r} is not served here (served: "
                           f"{', '.join(map(repr, self.ctx.models.names))} and {adapters} LoRA adapters)")
        self.write_json(adapter_card(self.ctx, adapter, slot.name))


class MetricsHandler(GetHandler):
    public = True

    def get(self) -> None:
        self.set_header("Content-Type", METRICS_CONTENT_TYPE)
        self.write(self.ctx.metrics.exposition())


class LoadsHandler(GetHandler):
    """``GET /v1/loads[?model=NAME]``: each model's load in SGLang's shape, for a gateway (service/loads.py)."""

    public = True  # the figures /metrics shows, as JSON

    def get(self) -> None:
        model = self.get_query_argument("model", None)
        if model is not None and model not in self.ctx.models.names:
            raise NotFound(f"model {model!r} is not served here (served: {', '.join(self.ctx.models.names)})")
        self.write_json(worker_loads(self.ctx.models.slots, model))


class OpenAPIHandler(GetHandler):
    public = True

    def get(self) -> None:
        served = Served(tuple(card["id"] for card in model_list(self.ctx)["data"]),
                        tuple(self.ctx.accepted_part_types()), self.ctx.backend.info().get("vocab_size"))
        self.write_json(build_openapi(self.ctx.schemas, playground=self.ctx.settings.playground_enabled,
                                      served=served))
