"""The ``mindserve`` command line: serve, convert-gguf, validate-config."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from service.config import DEFAULT_MODEL_NAME, ConfigFileError, ServerConfig, load_server_config

log = logging.getLogger("mindserve")
DEFAULT_CONFIG = Path("configs/server.yaml")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")


def prepare_model(cfg: ServerConfig) -> Path:
    """The model directory; the default model is downloaded and converted on first use."""
    path = cfg.model.weight_path
    if path.is_dir() and any(path.glob("*.yaml")):
        return path
    if path.name == DEFAULT_MODEL_NAME:
        from backends.mindspore.default_model import ensure_default_model

        log.info("default model not found at %s: preparing it (download + conversion)", path)
        return ensure_default_model(path.parent)
    raise ConfigFileError(f"{cfg.path}: BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath: "
                          f"{path} is not a model directory (no .yaml inside)")


async def serve(cfg: ServerConfig) -> None:
    from service.tls import server_ssl_context

    ssl_context = server_ssl_context(cfg.server, cfg.path)  # before loading: a bad key stops start-up at once

    import tornado.httpserver
    import tornado.netutil

    from backends.loader import load_backend
    from service.admission import Admission
    from service.app import make_app, planes_by_port
    from service.metrics import ServiceMetrics
    from service.state import ServerState
    backend = load_backend(cfg.model.backend_type, prepare_model(cfg), cfg.engine, model_name=cfg.model.name,
                           progress=True)
    state, metrics = ServerState(), ServiceMetrics.for_backend(backend)
    admission = Admission(cfg.server.max_link_num)
    scheme = "https" if ssl_context is not None else "http"
    servers = []
    for port, planes in planes_by_port(cfg.server).items():  # the business port first
        app = make_app(backend, cfg.server, state=state, metrics=metrics, admission=admission, planes=planes)
        server = tornado.httpserver.HTTPServer(app, ssl_options=ssl_context,
                                               max_body_size=cfg.server.max_request_bytes + (1 << 20))
        sockets = tornado.netutil.bind_sockets(port, cfg.server.ip_address)
        server.add_sockets(sockets)
        servers.append(server)
        log.info("listening on %s://%s:%d (%s; model %s)", scheme, cfg.server.ip_address,
                 sockets[0].getsockname()[1], ", ".join(sorted(planes)), backend.model_name)
    state.mark_ready()  # the backend is warmed up and every plane listens: /health turns 200
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal cuts the grace period short
        loop.add_signal_handler(sig, lambda: (force if stop.is_set() else stop).set())
    await stop.wait()
    await drain(cfg.server.shutdown_grace_period, state=state, admission=admission, force=force)
    for server in servers:
        server.stop()
    await loop.run_in_executor(None, backend.close)  # fails what is left in the engine: those clients hear so
    await _wait_until(lambda: admission.in_flight == 0, seconds=2.0)
    for server in servers:
        await server.close_all_connections()
    log.info("stopped")


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
    cfg = load_server_config(args.config)
    if args.port is not None:
        from dataclasses import replace

        cfg = replace(cfg, server=replace(cfg.server, port=args.port))
    asyncio.run(serve(cfg))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from backends.mindspore.gguf_convert import convert_gguf

    out = convert_gguf(Path(args.gguf), Path(args.out), model_name=args.name, progress=not args.quiet)
    print(out)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = load_server_config(args.config)
    print(f"{args.config}: OK (model {cfg.model.name} at {cfg.model.weight_path}, "
          f"listening on {cfg.server.ip_address}:{cfg.server.port})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindserve", description="MindSpore LLM inference server "
                                     "(TGI 0.9.4-compatible POST /).")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="load the model from the server config and serve it")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help=f"server config, YAML or the reference config.json shape (default {DEFAULT_CONFIG})")
    p.add_argument("--port", type=int, default=None, help="override ServerConfig.port")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("convert-gguf", help="turn a GGUF file into a model directory (safetensors, "
                       "tokenizer, config.json, predict yaml)")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="the model directory to write (created; an existing conversion is reused)")
    p.add_argument("--name", default=None, help="model name used for the yaml file (default: from the file name)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("validate-config", help="check a server config file against schemas/ and exit")
    p.add_argument("config", type=Path, help="the server config file")
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level.upper())
    try:
        return args.func(args)
    except ConfigFileError as exc:
        print(f"mindserve: config error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"mindserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
