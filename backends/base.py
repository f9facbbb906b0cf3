"""The backend protocol the service talks to, and the per-request handle that carries events back."""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Protocol

from backends.errors import BackendError, GenerationFailed
from backends.types import GenerationResult, Grammar, MediaInput, RequestParams, TokenEvent

Event = TokenEvent | GenerationResult | BackendError
Listener = Callable[[Event], None]
MEDIA_KINDS = ("image", "video", "audio")  # every kind a ``MediaInput`` may have


class RequestHandle:
    """Events of one request: TokenEvents, then exactly one GenerationResult or BackendError.

    Consumers either iterate (``events()``/``result()``, blocking) or register a listener that the
    engine thread calls for each event (the service bridges that to its event loop).
    """

    def __init__(self, request_id: str, listener: Listener | None = None) -> None:
        self.request_id = request_id
        self._listener = listener
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self.done = threading.Event()

    def cancel(self) -> None:
        """Ask the engine to stop this request; it frees the slot at its next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        if self.done.is_set():
            return
        if not isinstance(event, TokenEvent):
            self.done.set()
        if self._listener is not None:
            self._listener(event)
        else:
            self._queue.put(event)

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent | GenerationResult]:
        """Yield token events then the final result; raise the BackendError if the request failed."""
        while True:
            try:
                event = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise GenerationFailed(f"no event within {timeout}s") from None
            if isinstance(event, BackendError):
                raise event
            yield event
            if isinstance(event, GenerationResult):
                return

    def result(self, timeout: float | None = None) -> GenerationResult:
        for event in self.events(timeout):
            if isinstance(event, GenerationResult):
                return event
        raise GenerationFailed("request ended without a result")


class Backend(Protocol):
    """What ``service/`` needs from a model backend."""

    model_name: str
    # The media kinds (of MEDIA_KINDS) the model takes beside text; empty: a text-only model. Optional: a
    # backend without the attribute is text-only (``accepted_media``).
    media_kinds: frozenset[str]

    def submit(self, inputs: str, params: RequestParams, listener: Listener | None = None,
               media: tuple[MediaInput, ...] = ()) -> RequestHandle:
        """Tokenize, check limits (raising InputRejected), queue; events arrive on the handle. ``media``
        (only of ``media_kinds``, each placed in ``inputs`` by its ``position``) is passed only when the
        request has some: a text-only backend may leave the argument out."""

    def count_tokens(self, text: str) -> int: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids ``submit`` would use for ``text`` (before ``truncate``); without the special tokens the
        tokenizer adds (BOS) if not ``add_special_tokens``."""

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included; ``ParameterRejected("tokens", …)`` naming the first id
        outside the vocabulary."""

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary string; ``ParameterRejected("tokens", …)`` as ``detokenize``."""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """The prompt text for chat messages ([{"role", "content"}, ...]), ending with the assistant's opening
        if ``add_generation_prompt``; InputRejected if impossible. ``variables``: more template variables
        (``tools``, chat_template_kwargs); a backend may take none when no request sends any. Its
        ``chat_template`` attribute (optional) is the template's text."""

    def check_grammar(self, grammar: Grammar) -> None:
        """Optional: raise ``ParameterRejected("grammar", …)`` if ``grammar`` does not compile or is over the
        grammar engine's limits (the service asks before a request takes a slot; a backend without it is
        asked nothing and refuses at ``submit``)."""

    def info(self) -> dict:
        """Live figures for /info and /metrics: model_name, dtype, max_seq_len, max_input_tokens,
        max_batch_size, max_prefill_tokens, block_size, free_blocks, total_blocks, running, waiting,
        priorities ({priority: {"waiting", "running"}}), vocab_size (the tokenizer's), compiled_graphs (a key
        may be missing; the service then reports null)."""

    def adapters(self) -> list[dict]:
        """The LoRA adapters requests may name (``adapter_id``, an OpenAI ``model``): each a dict with at least
        ``name``, ``rank``, ``targets``, ``scale`` (empty without adapters)."""

    def load_adapter(self, name: str, path: str) -> dict:
        """Load a PEFT adapter at run time; its ``adapters()`` entry. ValueError (AdapterError) if refused."""

    def unload_adapter(self, name: str) -> bool:
        """Refuse new requests for ``name``; True if its slot was freed at once. KeyError if not loaded."""

    def close(self) -> None: ...


def accepted_media(backend: Backend) -> frozenset[str]:
    """The media kinds ``backend`` takes beside text: its ``media_kinds``, none when it declares none."""
    return frozenset(getattr(backend, "media_kinds", ()))
