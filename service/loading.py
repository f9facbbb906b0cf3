"""Loading the model behind open sockets: a stand-in backend until the real one is loaded and warmed up.

``serve`` binds its ports first, so that ``/health`` answers 503 and ``/v2/health/live`` 200 while the
model loads; ``load_in_background`` runs the slow load and warm-up in a daemon thread, and ``LoadingBackend``
answers for the backend meanwhile (503 for anything that needs the model) and forwards once it is attached.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backends.base import Backend, Listener, RequestHandle, accepted_media
from backends.errors import EngineUnavailable
from backends.limits import prompt_token_limit
from backends.settings import EngineConfig
from backends.types import Grammar, MediaInput, RequestParams

NOT_LOADED = "the model is still loading or warming up"
LOAD_THREAD = "mindserve-load"


class LoadingBackend:
    """The service's backend from start-up on: a 503 until ``attach``, then the loaded backend."""

    def __init__(self, model_name: str, config: EngineConfig | None) -> None:
        self.model_name = model_name
        self._config = config
        self._backend: Backend | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._backend is not None

    def attach(self, backend: Backend) -> None:
        """Serve through ``backend`` from now on (closed at once if this stand-in was closed meanwhile)."""
        with self._lock:
            self._backend = backend
            closed = self._closed
        if closed:
            backend.close()

    @property
    def loaded_backend(self) -> Backend:
        """The backend attached (``EngineUnavailable`` before)."""
        return self._loaded()

    def detach(self) -> Backend | None:
        """Stop serving through the backend attached (the model is being unloaded) and hand it back: from now
        on requests get the 503 of a model that is not loaded, and ``attach`` may load it again."""
        with self._lock:
            backend, self._backend = self._backend, None
        return backend

    def _loaded(self) -> Backend:
        if self._backend is None:
            raise EngineUnavailable(NOT_LOADED)
        return self._backend

    @property
    def media_kinds(self) -> frozenset[str]:
        """The loaded backend's; none before (requests are refused with 503 then anyway)."""
        return frozenset() if self._backend is None else accepted_media(self._backend)

    def submit(self, inputs: str, params: RequestParams, listener: Listener | None = None,
               media: tuple[MediaInput, ...] = ()) -> RequestHandle:
        if media:
            return self._loaded().submit(inputs, params, listener, media=media)
        return self._loaded().submit(inputs, params, listener)

    def count_tokens(self, text: str) -> int:
        return self._loaded().count_tokens(text)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._loaded().tokenize(text, add_special_tokens)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._loaded().detokenize(ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return self._loaded().token_strs(ids)

    def check_grammar(self, grammar: Grammar) -> None:
        check = getattr(self._loaded(), "check_grammar", None)
        if check is not None:
            check(grammar)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        return self._loaded().apply_chat_template(messages, add_generation_prompt, **variables)

    @property
    def chat_template(self) -> str | None:
        return getattr(self._backend, "chat_template", None) if self._backend is not None else None

    def adapters(self) -> list[dict]:
        """The loaded backend's adapters; before (or after an unload), the configured LoraModules."""
        backend = self._backend
        if backend is not None:
            return backend.adapters()
        modules = self._config.lora.modules if self._config is not None else ()
        return [{"name": m.name, "path": str(m.path)} for m in modules]

    def load_adapter(self, name: str, path: str) -> dict:
        return self._loaded().load_adapter(name, path)

    def unload_adapter(self, name: str) -> bool:
        return self._loaded().unload_adapter(name)

    def info(self) -> dict:
        """The loaded backend's figures; before that, what the config says (the rest is null)."""
        backend = self._backend
        if backend is not None:
            return backend.info()
        c = self._config or EngineConfig()
        return {"model_name": self.model_name, "max_seq_len": c.max_seq_len, "max_batch_size": c.max_batch_size,
                "max_input_tokens": prompt_token_limit(c).tokens,
                "max_prefill_tokens": c.max_prefill_tokens, "block_size": c.block_size, "compiled_graphs": 0}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            backend = self._backend
        if backend is not None:
            backend.close()


def load_in_background(load: Callable[[], Backend], into: LoadingBackend) -> asyncio.Future:
    """Run ``load()`` in a daemon thread and attach its backend to ``into``; the returned future (of the
    running loop) then gets None, or the exception ``load`` raised. A daemon thread, not the loop's
    executor: a signal during warm-up must not have to wait for the warm-up to end."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if future.done():  # serve stopped waiting
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            into.attach(load())
        except BaseException as exc:  # noqa: BLE001 - every failure must reach serve, or start-up would hang
            error = exc
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:  # the loop is closed: serve has returned already
            pass

    threading.Thread(target=run, name=LOAD_THREAD, daemon=True).start()
    return future
