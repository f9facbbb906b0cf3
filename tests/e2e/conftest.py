"""Live servers for the end-to-end tests: real Tornado servers on real sockets (127.0.0.1), in a background
thread, each app built by ``make_app`` and served by ``start_http_server`` as the CLI does."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace as _replace

import pytest
import tornado.netutil


class LiveServers:
    """One asyncio loop in a thread; each ``start`` binds a new app on 127.0.0.1:<free port>."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list = []

    def start(self, backend, settings=None, *, ssl_options=None, **app_kwargs) -> str:
        """Bind an app for ``backend``; with ``ssl_options`` (an ``ssl.SSLContext``) it serves HTTPS."""
        from service.app import make_app
        from service.config import ServerSettings

        settings = settings or ServerSettings()

        async def bind():
            from service.connections import start_http_server

            app = make_app(backend, settings, **app_kwargs)
            sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
            self.servers.append(start_http_server(app, sockets, ssl_options=ssl_options))
            return sockets[0].getsockname()[1]

        port = asyncio.run_coroutine_threadsafe(bind(), self.loop).result(30)
        return f"{'https' if ssl_options is not None else 'http'}://127.0.0.1:{port}"

    def close(self) -> None:
        for server in self.servers:
            self.loop.call_soon_threadsafe(server.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def live_servers():
    servers = LiveServers()
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def server_url(live_servers, default_engine):
    """POST / on the default model with the default server settings (token ids as lists)."""
    return live_servers.start(default_engine)


@pytest.fixture(scope="session")
def server_url_int_ids(live_servers, default_engine):
    """The same engine behind a server with ``tokenIdFormat: int`` (what the HF client needs)."""
    from service.config import ServerSettings

    return live_servers.start(default_engine, _replace(ServerSettings(), token_id_format="int"))


@pytest.fixture(scope="session")
def server_url_full_text(live_servers, default_engine):
    """The same engine behind a server with ``fullTextEnabled: true``."""
    from service.config import ServerSettings

    return live_servers.start(default_engine, _replace(ServerSettings(), full_text_enabled=True))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny model with a Qwen3-like chat template (Hermes tool calls, <think> reasoning)."""
    from tests.support.tiny_chat_model import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def chat_url(live_servers, chat_model):
    """A server of ``chat_model`` (one per test module)."""
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=1536, max_input_tokens=1400, max_batch_size=4, max_iter_times=64,
                          block_size=64, prefill_chunk=256, window_buckets=(1536,), batch_buckets=(1, 4))
    with Engine(chat_model, config) as engine:
        yield live_servers.start(engine)
