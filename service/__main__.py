"""The ``mindserve`` command line: serve, pull, models, rm, convert-gguf, validate-config."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from service.config import ConfigFileError, ModelSettings, ServerConfig, load_server_config
from service.install_check import import_name_conflict
from service.loading import LOAD_THREAD
from service.model_commands import add_model_commands
from service.serve_args import add_serve_arguments, models_dir_default

if TYPE_CHECKING:
    import ssl

    import tornado.web

log = logging.getLogger("mindserve")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")


ModelPreparer = Callable[[ModelSettings], Path]  # one served model's directory, converted first if need be


def _prepare(model: ModelSettings) -> Path:
    """The model directory of one ModelConfig entry with the defaults (no --dtype, the default model cache)."""
    from service.model_prep import prepare_model

    return prepare_model(model, models_dir=models_dir_default(os.environ))


class StartupFailed(Exception):
    """The model could not be loaded or warmed up (logged already); ``serve`` exits 1."""


async def serve(cfg: ServerConfig, prepare: ModelPreparer = _prepare) -> None:
    """Check what can be checked, bind every listener (``/health`` 503, ``/v2/health/live`` 200), load and
    warm up the model in the background, then turn ready; on SIGTERM/SIGINT drain and stop."""
    from service.preflight import check_models, check_tls

    ssl_context = check_tls(cfg)  # before anything slow: a bad key or model directory stops start-up at once
    checks = check_models(cfg)  # every model, the memory budget covering those loaded at once

    from service.admission import Admission
    from service.app import make_app
    from service.connections import ConnectionTracker
    from service.media.loader import MediaLoader
    from service.media.policy import MediaPolicy
    from service.metrics import ServiceMetrics
    from service.models import registry_for
    from service.state import ServerState

    models = registry_for(cfg.models, cfg.max_loaded_models, prepare, checks)
    backend = models.first
    state, metrics = ServerState(), ServiceMetrics.for_models(models)
    admission, connections = Admission(cfg.server.max_link_num), ConnectionTracker(cfg.server)
    media = MediaLoader(MediaPolicy.from_settings(cfg.server, os.environ))  # the one read of the whitelist
    hosts = ", ".join(sorted(media.policy.domains))
    log.info("media: local files under %s; remote media %s", media.policy.root,
             f"from {hosts}" if hosts else "refused (ALLOWED_MEDIA_DOMAINS_ENV lists no host)")
    servers, business_url = listen(cfg, ssl_context, lambda planes: make_app(
        backend, cfg.server, state=state, metrics=metrics, admission=admission, connections=connections,
        media=media, planes=planes, lora=cfg.engine.lora, models=models))
    started = time.monotonic()
    names = ("model " if models.limit == 1 else "models ") + ", ".join(models.names[:models.limit])
    log.info("loading %s; /health answers 503 until %s loaded and warmed up", names,
             "it is" if models.limit == 1 else "they are")
    # graphCache: the serve process compiles nothing before the first engine's warm-up, so MindSpore's compile
    # cache (numbered by the order of compilation in the process) keeps the same graphs under the same numbers.
    loading = asyncio.ensure_future(models.preload())
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal cuts the grace period short
        loop.add_signal_handler(sig, lambda: (force if stop.is_set() else stop).set())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        stopping.cancel()
        await _close(servers)
        raise _startup_failed(loading.exception())
    if loading.done():
        # Everything loaded so far (MindSpore's graphs and cells, the tokenizer, the weights' wrappers) lives as
        # long as the process: out of the cyclic collector's sight, whose full passes over it took ~4% of the
        # CPU of a 16-client decode (perf, gc_collect_main).
        gc.collect()
        gc.freeze()
        state.mark_ready()
        log.info("ready: %s loaded and warmed up in %.1fs; listening on %s", names, time.monotonic() - started,
                 business_url)
    else:
        loading.cancel()  # the load thread is left behind; cmd_serve ends the process without waiting for it
        log.info("stopping before the model finished loading")
    await stopping
    await drain(cfg.server.shutdown_grace_period, state=state, admission=admission, force=force)
    for server in servers:
        server.stop()
    await loop.run_in_executor(None, models.close)  # fails what is left in the engines: those clients hear so
    await _wait_until(lambda: admission.in_flight == 0, seconds=2.0)
    await _close(servers)
    connections.close()
    log.info("stopped")


def listen(cfg: ServerConfig, ssl_context: ssl.SSLContext | None,
           app_for: Callable[[frozenset[str]], tornado.web.Application]) -> tuple[list, str]:
    """One HTTP server per (address, port) with ``app_for(its planes)``, bound now; (servers, business URL)."""
    from service.config import planes_by_listener
    from service.connections import bind, start_http_server
    from service.preflight import bind_error

    scheme = "https" if ssl_context is not None else "http"
    servers, urls = [], []
    for (address, port), planes in planes_by_listener(cfg.server).items():  # the business listener first
        try:
            sockets = bind(port, address, cfg.server)
        except OSError as exc:
            for server in servers:
                server.stop()
            raise bind_error(cfg, address, port, planes, exc) from None
        servers.append(start_http_server(app_for(planes), sockets, ssl_options=ssl_context))
        host = f"[{address}]" if ":" in address else address
        urls.append(f"{scheme}://{host}:{sockets[0].getsockname()[1]}")
        log.info("listening on %s (%s; model %s)", urls[-1], ", ".join(sorted(planes)), cfg.model.name)
    return servers, urls[0]


def _startup_failed(exc: BaseException) -> StartupFailed:
    expected = isinstance(exc, (ValueError, OSError, ConfigFileError))
    log.error("start-up failed: the model could not be loaded or warmed up: %s: %s", type(exc).__name__, exc,
              exc_info=None if expected else exc)
    return StartupFailed(str(exc))


async def _close(servers: list) -> None:
    for server in servers:
        server.stop()
        await server.close_all_connections()


async def drain(grace: float, *, state, admission, force: asyncio.Event) -> None:
    """Stop taking requests (503, ``/health`` 503) and give those in flight ``grace`` seconds to finish."""
    from service.errors import ServiceUnavailable

    log.info("shutting down: new requests get 503; %d in flight get up to %g s to finish",
             admission.in_flight, grace)
    state.start_draining()
    admission.reject_waiting(ServiceUnavailable("the server is shutting down"))
    await _wait_until(lambda: admission.in_flight == 0 or force.is_set(), seconds=grace)
    if admission.in_flight:
        log.warning("shutting down: %d requests still in flight are cut off", admission.in_flight)


async def _wait_until(done, *, seconds: float, poll: float = 0.05) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(poll)


def cmd_serve(args: argparse.Namespace) -> int:
    from service.model_prep import model_entries, prepare_model
    from service.serve_args import serve_config

    entries = model_entries(args.models, models_dir=args.models_dir, dtype=args.dtype) if args.models else None
    cfg = serve_config(args, entries)
    try:
        asyncio.run(serve(cfg, lambda model: prepare_model(model, models_dir=args.models_dir, dtype=args.dtype)))
    except StartupFailed:
        return 1
    if any(thread.name == LOAD_THREAD and thread.is_alive() for thread in threading.enumerate()):
        # Stopped during warm-up: end now rather than tear the interpreter down under a running compile.
        logging.shutdown()
        os._exit(0)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from backends.loader import convert_gguf

    out = convert_gguf(Path(args.gguf), Path(args.out), model_name=args.name, progress=not args.quiet,
                       dtype=args.dtype)
    print(out)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Every check ``serve`` makes before loading weights; busy ports are reported, not failed."""
    from service.preflight import busy_listeners, check_model, check_tls

    cfg = load_server_config(args.config)
    check_tls(cfg)
    model = check_model(cfg)
    for problem in busy_listeners(cfg):
        print(f"mindserve: warning: {args.config}: cannot listen on {problem} right now", file=sys.stderr)
    what = model.arch if model.prepared else "not prepared yet: serve downloads and converts it"
    print(f"{args.config}: OK (model {cfg.model.name} at {cfg.model.weight_path}: {what}; "
          f"listening on {cfg.server.ip_address}:{cfg.server.port})")
    if model.cache is not None:
        print(f"{args.config}: {model.cache.describe()}")
    return 0


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line naming it (no usage block), exit 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mindserve", description="MindSpore LLM inference server "
                     "(TGI 0.9.4-compatible POST /, OpenAI /v1 routes).")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    models_dir = models_dir_default(os.environ)
    p = sub.add_parser("serve", help="serve MODEL (a GGUF, an HF directory, a model directory or a package), or "
                       "the model of a server config", description="Serve MODEL ... (converted into the model cache "
                       "on first use), or without MODEL the model the config names. No config file is needed: the "
                       "shipped one supplies every setting the flags do not.")
    add_serve_arguments(p, models_dir)
    p.set_defaults(func=cmd_serve)
    add_model_commands(sub, models_dir)
    p = sub.add_parser("convert-gguf", help="turn a GGUF file into a model directory (safetensors, "
                       "tokenizer, config.json, predict yaml)")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="the model directory to write (created; an existing conversion is reused)")
    p.add_argument("--name", default=None, help="model name used for the yaml file (default: from the file name)")
    p.add_argument("--dtype", choices=("fp32", "q8_0", "as-shipped"), default="fp32",
                   help="how the matrices are stored: fp32 (dequantized, the default), q8_0 (Q8_0 blocks; a Q4 GGUF "
                   "is requantized from its own weights) or as-shipped (the GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                   "Q4_K, Q5_K and Q6_K blocks kept as they are, a stack of mixed formats as segments); see "
                   "docs/configuration.md")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("validate-config", help="check a server config file as serve would, without loading "
                       "weights (schema, rules across keys, listen addresses, TLS files, model directory, "
                       "buckets), and exit: 0 if it is usable, 2 if not")
    p.add_argument("config", type=Path, help="the server config file")
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level.upper())
    conflict = import_name_conflict()
    if conflict is not None:
        print(f"mindserve: error: {conflict}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ConfigFileError as exc:
        print(f"mindserve: config error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"mindserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mindserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
