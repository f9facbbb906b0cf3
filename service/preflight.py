"""Start-up checks that read files other than the config, but load no weights: the backend's checks of the
model directory (``backends.loader.check_backend``: the bucket coverage against the model, the adapters, the
KV cache against the memory budget) mapped onto the server config's keys, the TLS files, and
(``validate-config`` only) busy ports.

``serve`` runs them before it binds its ports, ``validate-config`` runs them all; each failure is a
``ConfigFileError`` naming the config file and the key.
"""
from __future__ import annotations

import errno
import socket
import ssl

from backends.loader import (ADAPTERS, KV_CACHE, MEMORY, MODEL, SCHEDULE, SPECULATION, ModelCheck, PreflightError,
                             check_backends)
from service.config import BUSINESS, MANAGEMENT, METRICS, ConfigFileError, ServerConfig, planes_by_listener
from service.tls import server_ssl_context

MODEL_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath"
MEMORY_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].npuMemSize"
_ENTRY = "BackendConfig.ModelDeployConfig.ModelConfig[{}]"
BACKEND_KEYS = {MODEL: _ENTRY + ".modelWeightPath", MEMORY: _ENTRY + ".npuMemSize",
                SCHEDULE: "BackendConfig.ScheduleConfig", ADAPTERS: "BackendConfig.ModelDeployConfig.LoraModules",
                KV_CACHE: _ENTRY + ".kvCacheDtype", SPECULATION: _ENTRY + ".plugin_params draft_model_path"}

__all__ = ["MODEL_KEY", "ModelCheck", "bind_error", "busy_listeners", "check_model", "check_models", "check_tls"]


def check_model(cfg: ServerConfig) -> ModelCheck:
    """The first model's ``check_models``, after every model's."""
    return check_models(cfg)[0]


def check_models(cfg: ServerConfig) -> list[ModelCheck]:
    """The backend's own checks of every model directory (``backends.loader.check_backends``: yaml, weights
    file, tokenizer, window buckets, adapters, the KV caches against the memory budget, which covers the models
    loaded at once), each failure named by the server config's key."""
    try:
        return check_backends([(m.backend_type, m.weight_path, m.engine) for m in cfg.models], cfg.resident_models)
    except PreflightError as exc:
        key = BACKEND_KEYS[exc.about].format(exc.index)
        if exc.about == MEMORY and cfg.resident_models > 1:
            key += (f" (with {cfg.resident_models} models loaded at once: BackendConfig.ModelDeployConfig."
                    "maxLoadedModels, and each model's npuMemSize)")
        raise ConfigFileError(f"{cfg.path}: {key}{exc.detail}") from None


def check_tls(cfg: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context: the certificate, key (owner-only mode) and CA files load (None without
    httpsEnabled)."""
    return server_ssl_context(cfg.server, cfg.path)


def busy_listeners(cfg: ServerConfig) -> list[str]:
    """The listen addresses that cannot be bound right now, each with the reason (port 0 is never busy).
    Not an error of the file: the port may be held by a server this config is about to replace."""
    problems = []
    for (address, port), planes in planes_by_listener(cfg.server).items():
        if port == 0:
            continue
        try:
            infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            for family, kind, proto, _, sockaddr in infos:
                with socket.socket(family, kind, proto) as sock:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(sockaddr)
        except OSError as exc:
            reason = "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            problems.append(f"{address}:{port} ({', '.join(sorted(planes))}): {reason}")
    return problems


def bind_error(cfg: ServerConfig, address: str, port: int, planes: frozenset[str], exc: OSError) -> ConfigFileError:
    """The config error for a listener ``serve`` could not bind, naming the keys that chose it."""
    ports = [key for plane, key in ((MANAGEMENT, "managementPort"), (METRICS, "metricsPort")) if plane in planes]
    keys = "ipAddress/port" if BUSINESS in planes else "/".join(["managementIpAddress", *ports])
    reason = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return ConfigFileError(f"{cfg.path}: ServerConfig.{keys}: cannot listen on {address}:{port} "
                           f"({', '.join(sorted(planes))}): {reason}")
