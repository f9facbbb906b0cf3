"""The one generation pipeline every dialect runs through (``service/dialects/``).

``GenerationHandler``: read the body (the reading bound of ``service/http.py``), parse it with the route's
dialect, check its grammar if any (``service/grammar_check.py``), load its media parts if any
(``service/media/loader.py``), both holding no slot, *then* take a generation slot
(``service/admission.py``: 429 when the line is full, 503 while draining), submit to the backend off the
event loop, and relay its events as one JSON body or an SSE stream under the deadlines
(``tokenTimeout``, ``e2eTimeout``, a stalled reader); a client that leaves cancels the engine request (or
its media load). Errors are rendered by the dialect.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import replace
from typing import Any

import tornado.gen
import tornado.iostream
import tornado.queues
import tornado.util

from backends.base import Event, RequestHandle
from backends.errors import BackendError
from backends.types import GenerationResult, MediaInput, TokenEvent
from service import sse
from service.access_log import CLIENT_GONE
from service.admission import Deadlines
from service.context import AppContext
from service.dialects import Dialect, GenerationRequest, choice_params
from service.errors import ServiceError, ServiceUnavailable, from_backend_error
from service.grammar_check import CHECK_SECONDS
from service.http import JsonBodyHandler
from service.media.gate import Lease
from service.metrics import BASE_ADAPTER, RequestObserver
from service.models import ModelLease

log = logging.getLogger("mindserve.http")

STALLED_CLIENT_GRACE = 0.5  # seconds a write may still take once the request's e2eTimeout has passed


class GenerationHandler(JsonBodyHandler):
    """One generation route: its ``dialect`` parses and renders, everything else happens here."""

    _handle: RequestHandle | None = None  # the first choice's (its id names the request in logs)
    _handles: tuple[RequestHandle, ...] = ()  # one per choice (n > 1: several sequences of one prompt)
    _admitting: asyncio.Task | None = None
    _lease: ModelLease | None = None  # the model the request runs on, held loaded until it ends
    _acquiring: asyncio.Task | None = None  # waiting for that model to load
    _admitted = False
    _loading: asyncio.Task | None = None  # the request's media being loaded
    _media_lease: Lease | None = None  # what the request's media hold of the media gate, until it ends
    observer: RequestObserver | None = None  # metrics + access-log token counts, from prepare() on
    deadlines: Deadlines | None = None

    def initialize(self, ctx: AppContext, dialect: Dialect) -> None:  # type: ignore[override]
        super().initialize(ctx)
        self.dialect = dialect

    def render_error(self, error: ServiceError) -> tuple[int, Any]:
        if self.observer is not None:
            self.observer.error_sent(error.error_type.value)
        return self.dialect.render_error(error)

    def prepare(self) -> Any:
        self.observer = RequestObserver(self.ctx.metrics)
        self.deadlines = Deadlines(self.ctx.settings.token_timeout, self.ctx.settings.e2e_timeout)
        super().prepare()
        if self.request.method == "POST" and not self.ctx.state.ready:
            self.refuse(ServiceUnavailable(self.ctx.state.describe()))

    async def post(self) -> None:
        body = self.json_body()
        if not await self._acquire_model(body):
            return  # the client left while its model loaded
        req = self.dialect.parse(body, self.ctx)  # the whole body is in, and valid
        await self._check_grammar(req)
        media = await self._load_media(req)
        if media is None or not await self._admit():
            return  # the client left while its media loaded or while it waited for a slot
        events = await self._submit(req, media)
        # Labelled only once the engine took it: a name that is not loaded never becomes a label value.
        self.observer.adapter = req.params.adapter_id or BASE_ADAPTER
        if req.stream:
            await self._stream(req, events)
        else:
            results = await self._results(events, req.choices)
            self.write_json(self.dialect.render_result(req, results, self.ctx))
        log.debug("%s %s done in %.3fs", self._handle.request_id, self.request.path,
                  time.monotonic() - self.deadlines.started)

    # --- model, grammar, media, admission and submission --------------------------------------------

    async def _acquire_model(self, body: Any) -> bool:
        """Hold the model the body names (loading it if need be, within the e2e deadline); this request's
        context then serves that model. False if the client left meanwhile."""
        models = self.ctx.models
        self._acquiring = asyncio.ensure_future(models.acquire(self.dialect.requested_model(body),
                                                               self.deadlines.e2e_left()))
        try:
            self._lease = await self._acquiring
        except asyncio.CancelledError:
            return False
        finally:
            self._acquiring = None
        self.ctx = replace(self.ctx, backend=self._lease.backend)
        return True

    async def _check_grammar(self, req: GenerationRequest) -> None:
        """A grammar over the grammar engine's limits is the dialect's 422 now, before any slot is taken."""
        try:
            await self.ctx.grammars.check(self.ctx.backend, req.params.grammar, min(CHECK_SECONDS,
                                                                                   self.deadlines.e2e_left()))
        except BackendError as exc:
            raise self.dialect.submit_error(exc, req) from None

    async def _load_media(self, req: GenerationRequest) -> tuple[MediaInput, ...] | None:
        """The request's media, loaded before it takes a slot (a slow download holds none); None if the
        client left meanwhile. The bytes stay counted in the media gate until the request ends."""
        if not req.media:
            return ()
        self._media_lease = self.ctx.media.lease()
        self._loading = asyncio.ensure_future(self.ctx.media.load(req.media, self._media_lease,
                                                                   self.deadlines.e2e_left()))
        try:
            return await self._loading
        except asyncio.CancelledError:
            return None
        finally:
            self._loading = None

    async def _admit(self) -> bool:
        """Take a generation slot, waiting in line within the e2e deadline; False if the client left
        meanwhile (it leaves the line)."""
        if not self.ctx.state.ready:
            raise ServiceUnavailable(self.ctx.state.describe())
        self._admitting = asyncio.ensure_future(self.ctx.admission.acquire(self.deadlines.e2e_left()))
        try:
            await self._admitting
        except asyncio.CancelledError:
            return False
        finally:
            self._admitting = None
        self._admitted = True
        return True

    async def _submit(self, req: GenerationRequest, media: tuple[MediaInput, ...] = ()) -> tornado.queues.Queue:
        """Submit off the loop (a chat template renders there too), one engine request per choice; the
        events arrive on the returned queue as (choice index, event). ``media`` goes beside the prompt only
        when there is some (a text-only backend's ``submit`` need not take it)."""
        events: tornado.queues.Queue = tornado.queues.Queue()
        loop = asyncio.get_running_loop()
        backend, observer = self.ctx.backend, self.observer

        def listener_of(index: int):
            def listener(event: Event) -> None:
                observer.on_event(event)
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            return listener

        def submit_all() -> tuple[RequestHandle, ...]:
            prompt, handles = req.render_prompt(backend), []
            prompt, placed = req.place_media(prompt, media)
            extra = {"media": placed} if placed else {}
            try:
                for i in range(req.choices):
                    handles.append(backend.submit(prompt, choice_params(req.params, i), listener_of(i), **extra))
            except BackendError:
                for handle in handles:  # the choices already queued go too
                    handle.cancel()
                raise
            return tuple(handles)

        try:
            self._handles = await loop.run_in_executor(None, submit_all)
        except BackendError as exc:
            raise self.dialect.submit_error(exc, req) from None
        self._handle = self._handles[0]
        if self.client_gone:  # the client left while the request was being queued
            self._cancel()
        return events

    def _cancel(self) -> None:
        for handle in self._handles:
            handle.cancel()

    # --- relaying events ---------------------------------------------------------------------------

    async def _next_event(self, events: tornado.queues.Queue) -> tuple[int, TokenEvent | GenerationResult]:
        """The next (choice index, event); a failed request raises its service error (cancelling its other
        choices), a missed deadline cancels it and raises ``IncompleteGeneration``."""
        try:
            item = await events.get(timeout=datetime.timedelta(seconds=max(self.deadlines.left(), 0.0)))
        except tornado.util.TimeoutError:
            self._cancel()
            self.observer.fail()
            error = self.deadlines.expired()
            log.warning("%s %s: %s", self._handle.request_id, self.request.path, error.message)
            raise error from None
        return self._checked(item)

    def _checked(self, item: tuple[int, Event]) -> tuple[int, TokenEvent | GenerationResult]:
        """A queued (choice index, event): a failed request raises its service error (cancelling its other
        choices); a token restarts the token deadline."""
        index, event = item
        if isinstance(event, BackendError):
            self._cancel()
            raise from_backend_error(event)
        if isinstance(event, TokenEvent):
            self.deadlines.token()
        return index, event

    async def _results(self, events: tornado.queues.Queue, choices: int) -> list[GenerationResult]:
        """Every choice's result, in choice order."""
        results: dict[int, GenerationResult] = {}
        while len(results) < choices:
            index, event = await self._next_event(events)
            if isinstance(event, GenerationResult):
                results[index] = event
        return [results[i] for i in range(choices)]

    async def _stream(self, req: GenerationRequest, events: tornado.queues.Queue) -> None:
        """Relay a stream's events (it has one choice), each its own SSE event. The events already queued when one
        arrives (a speculative step's accepted tokens come together) are written with it and flushed once."""
        codec = self.dialect.stream_codec(req, self.ctx)
        while not self.client_gone:
            chunks: list[str] = []
            try:
                _, event = await self._next_event(events)
                while isinstance(event, TokenEvent) and not events.empty():
                    chunks += codec.on_token(event)
                    _, event = self._checked(events.get_nowait())
            except ServiceError as exc:
                if not self._headers_written and not chunks:  # nothing sent yet: a plain JSON error still fits
                    raise
                self.observer.error_sent(exc.error_type.value)
                await self._send(chunks + codec.on_error(exc))
                return
            if isinstance(event, GenerationResult):
                await self._send(chunks + codec.on_result(event))
                return
            await self._send(chunks + codec.on_token(event))

    async def _send(self, chunks: list[str]) -> None:
        """Write and flush SSE events; a client gone, or not reading past the request's e2eTimeout, cancels
        the request."""
        if not chunks or self.client_gone:
            return
        if not self._headers_written:
            for name, value in sse.HEADERS.items():
                self.set_header(name, value)
        self.write("".join(chunks))
        wait = datetime.timedelta(seconds=max(self.deadlines.e2e_left(), STALLED_CLIENT_GRACE))
        try:
            await tornado.gen.with_timeout(wait, self.flush(), quiet_exceptions=tornado.iostream.StreamClosedError)
        except tornado.iostream.StreamClosedError:
            self.on_connection_close()
        except tornado.util.TimeoutError:
            log.warning("%s %s: the client stopped reading; closing", self._handle.request_id, self.request.path)
            self.ctx.connections.timeouts["stalled_reader"] += 1
            self.request.connection.close()
            self.on_connection_close()

    # --- the end of a request ----------------------------------------------------------------------

    # A request refused before prepare() (a 405: the method is checked first) has no observer.

    def on_finish(self) -> None:
        self._release()
        if self.observer is not None:
            self.observer.finish(CLIENT_GONE if self.client_gone else self.get_status())
        super().on_finish()

    def on_connection_close(self) -> None:
        if self.client_gone:
            return
        super().on_connection_close()
        if self.observer is not None:
            self.observer.client_gone()
        self._cancel()
        if self._admitting is not None:
            self._admitting.cancel()
        if self._acquiring is not None:
            self._acquiring.cancel()
        if self._loading is not None:
            self._loading.cancel()

    def on_unfinished(self) -> None:
        self._release()
        if self.observer is not None:
            self.observer.finish(CLIENT_GONE)
        super().on_unfinished()

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._media_lease is not None:
            self._media_lease.release()
            self._media_lease = None
        if self._admitted:
            self._admitted = False
            self.ctx.admission.release()
