"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes (``schemas/tokenize_*``, ``detokenize_*``).

``/tokenize`` takes a ``prompt`` (vLLM's TokenizeCompletionRequest) or chat ``messages`` (TokenizeChatRequest:
rendered with the model's chat template first, as ``/v1/chat/completions`` does) and answers the ids, their
``count``, ``max_model_len`` and, if asked, each id's vocabulary string; ``/detokenize`` turns ids back into
text. Errors use the OpenAI shape (a 400 naming ``param``), as the routes' clients expect. The reference
server's ``/v1/tokenizer`` (``ops_handlers.py``) stays as it is.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from backends.errors import BackendError, InputRejected, ParameterRejected
from service.dialects.openai import openai_error
from service.dialects.openai_request import ROLE_ALIASES, InvalidRequest, check_body
from service.errors import ServiceError, from_backend_error
from service.http import JsonBodyHandler


class _VllmHandler(JsonBodyHandler):
    """A vLLM-shaped route: OpenAI errors, the body checked against ``schema`` and its ``model``."""

    schema = ""

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        return openai_error(error)

    _lease = None  # the model the body names, held loaded until the request ends (service/models.py)

    async def checked_body(self) -> dict[str, Any]:
        """The schema-checked body; ``ctx.backend`` is then the model it names (loaded if need be: within
        e2eTimeout), an unknown name is 404 model_not_found."""
        body = self.json_body()
        check_body(self.ctx.schemas, self.schema, body)
        self._lease = await self.ctx.models.acquire(body.get("model"), self.ctx.settings.e2e_timeout)
        self.ctx = replace(self.ctx, backend=self._lease.backend)
        return body

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def on_finish(self) -> None:
        self._release()
        super().on_finish()

    def on_unfinished(self) -> None:
        self._release()
        super().on_unfinished()

    async def off_loop(self, call, *args) -> Any:
        """``call(*args)`` on the executor (a tokenizer or template can take a while); the backend's refusals
        as OpenAI errors (503 while the model loads)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, call, *args)
        except ParameterRejected as exc:
            raise InvalidRequest(str(exc), exc.param) from None
        except InputRejected as exc:  # the chat template refused the messages
            raise InvalidRequest(str(exc), "messages") from None
        except BackendError as exc:
            raise from_backend_error(exc) from None


class TokenizeHandler(_VllmHandler):
    """``POST /tokenize``: ``{prompt | messages, add_special_tokens?, add_generation_prompt?,
    return_token_strs?}`` → ``{count, max_model_len, tokens, token_strs?}``."""

    schema = "tokenize_request"

    async def post(self) -> None:
        body = await self.checked_body()
        backend = self.ctx.backend
        special = body.get("add_special_tokens") is not False
        if "messages" in body:
            text = await self.off_loop(backend.apply_chat_template, chat_messages(body["messages"]),
                                       body.get("add_generation_prompt") is not False)
        else:
            text = body["prompt"]
        ids = await self.off_loop(backend.tokenize, text, special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": backend.info().get("max_seq_len"), "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = await self.off_loop(backend.token_strs, ids)
        self.write_json(out)


class DetokenizeHandler(_VllmHandler):
    """``POST /detokenize``: ``{tokens}`` → ``{prompt}``."""

    schema = "detokenize_request"

    async def post(self) -> None:
        body = await self.checked_body()
        ids = [int(i) for i in body["tokens"]]  # JSON Schema also calls 20.0 an integer
        self.write_json({"prompt": await self.off_loop(self.ctx.backend.detokenize, ids)})


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The schema-checked messages as the chat template takes them: text parts joined, developer as system."""
    out = []
    for message in messages:
        content = message["content"]
        text = content if isinstance(content, str) else "".join(part["text"] for part in content)
        item = {"role": ROLE_ALIASES.get(message["role"], message["role"]), "content": text}
        if message.get("name"):
            item["name"] = message["name"]
        out.append(item)
    return out
