"""``POST /v1/messages/count_tokens``: ``{input_tokens}``, the prompt tokens ``/v1/messages`` reports
(``usage.input_tokens``) for the same request: the body is translated as that route translates it
(``anthropic_request.py``), its prompt rendered by the chat template and tokenized as ``submit`` does."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from backends.errors import BackendError
from service.dialects import body_model
from service.dialects.anthropic import MESSAGES, anthropic_error, key_refusal
from service.errors import ServiceError, ServiceUnavailable, Unauthorized
from service.http import JsonBodyHandler


class CountTokensHandler(JsonBodyHandler):
    """Errors in Anthropic's shape; the key also as ``x-api-key``; no generation slot is taken."""

    def key_refusal(self) -> Unauthorized | None:
        return key_refusal(self.ctx.settings.api_key, self.request.headers, super().key_refusal())

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        return anthropic_error(error)

    async def post(self) -> None:
        if not self.ctx.state.ready:
            raise ServiceUnavailable(self.ctx.state.describe())
        body = self.json_body()
        lease = await self.ctx.models.acquire(body_model(body), self.ctx.settings.e2e_timeout)  # the model named
        try:
            ctx = replace(self.ctx, backend=lease.backend)
            req = MESSAGES.parse(body, ctx, count=True)
            try:  # the template and the tokenizer can take a while: off the event loop
                await asyncio.get_running_loop().run_in_executor(None, req.render_prompt, ctx.backend)
            except BackendError as exc:
                raise MESSAGES.submit_error(exc, req) from None
        finally:
            lease.release()
        self.write_json({"input_tokens": req.counted.tokens})
