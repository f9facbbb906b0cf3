"""Start-up checks that read files other than the config, but load no weights: the model directory,
the bucket coverage against the model, the KV cache against the memory budget, the TLS files, and
(``validate-config`` only) busy ports.

``serve`` runs them before it binds its ports, ``validate-config`` runs them all; each failure is a
``ConfigFileError`` naming the config file and the key.
"""
from __future__ import annotations

import errno
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from backends.mindspore.default_model import DEFAULT_DIRS
from backends.mindspore.kernel_path import stock_expected
from backends.mindspore.memory import CachePlan, Footprint, MemoryBudgetError, available_memory, plan_cache
from backends.mindspore.shapes import ShapeError, plan_shapes
from service.config import (BUSINESS, MANAGEMENT, METRICS, ConfigFileError, ServerConfig, planes_by_listener,
                            schedule_key)
from service.tls import server_ssl_context

MODEL_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath"
MEMORY_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].npuMemSize"


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """What the model directory holds (``None`` fields: the default model, not prepared yet)."""

    directory: Path
    arch: str | None = None
    max_position_embeddings: int | None = None
    cache: CachePlan | None = None  # the KV cache the engine would allocate now

    @property
    def prepared(self) -> bool:
        return self.arch is not None


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.yaml"))


def check_model(cfg: ServerConfig) -> ModelCheck:
    """The model directory's yaml, config.json, weights file and tokenizer, and the window buckets against
    the model's ``max_position_embeddings``. The default model's directory may be absent: serve prepares it."""
    path = cfg.model.weight_path
    if not is_model_dir(path):
        if path.name in DEFAULT_DIRS:
            _check_windows(cfg, None)
            return ModelCheck(path)
        raise ConfigFileError(f"{cfg.path}: {MODEL_KEY}: {path} is not a model directory (no .yaml inside)")
    # The ms backend's model files; reading them imports no MindSpore.
    from backends.mindspore.config import ConfigError, load_model_spec
    from backends.mindspore.tokenizer import Tokenizer

    try:
        spec = load_model_spec(path)
    except (ConfigError, OSError, ValueError) as exc:
        raise ConfigFileError(f"{cfg.path}: {MODEL_KEY}: {exc}") from None
    if not spec.checkpoint.exists():
        raise ConfigFileError(f"{cfg.path}: {MODEL_KEY}: weights {spec.checkpoint} not found "
                              f"(load_checkpoint in {spec.yaml_path.name})")
    try:
        Tokenizer.from_model_dir(spec.model_dir, spec.tokenizer)
    except Exception as exc:  # noqa: BLE001 - tokenizers and mindformers raise plain exceptions
        raise ConfigFileError(f"{cfg.path}: {MODEL_KEY}: cannot load the tokenizer: {exc}") from None
    _check_windows(cfg, spec.max_position_embeddings)
    adapters = check_adapters(cfg, spec)
    return ModelCheck(spec.model_dir, spec.arch, spec.max_position_embeddings, check_memory(cfg, spec, adapters))


def check_adapters(cfg: ServerConfig, spec) -> list:
    """Every LoraModules adapter read and checked against the model, as the engine will load it: a bad one is
    an error naming its entry (the reference server warns and skips it; we refuse)."""
    from backends.lora import AdapterError, BaseDims, load_adapter

    from backends.mindspore.config import VL_ARCHS

    lora, dims, adapters = cfg.engine.lora, BaseDims.of(spec), []
    if lora.enabled and spec.arch in VL_ARCHS:
        raise ConfigFileError(f"{cfg.path}: BackendConfig.ModelDeployConfig.LoraModules: LoRA adapters are not "
                              f"supported for a vision-language model ({spec.arch}); remove LoraModules and "
                              "allowRuntimeLoraUpdating")
    for i, module in enumerate(lora.modules):
        try:
            adapters.append(load_adapter(module.name, module.path, dims, lora.max_rank or None))
        except AdapterError as exc:
            raise ConfigFileError(f"{cfg.path}: BackendConfig.ModelDeployConfig.LoraModules[{i}] "
                                  f"({module.name}, path {module.path}): {exc}") from None
    return adapters


def check_memory(cfg: ServerConfig, spec, adapters: list = ()) -> CachePlan:
    """The engine's own cache rule (``backends.mindspore.memory.plan_cache``) on the memory free now, the
    weights' size read from the safetensors headers, plus the adapter slots the engine would allocate."""
    from backends.lora import BaseDims
    from backends.mindspore.lora_slots import lora_slot_shape, slot_bytes

    extra = slot_bytes(BaseDims.of(spec), lora_slot_shape(cfg.engine.lora, list(adapters)))
    try:
        model = Footprint.of(spec, extra, stock=stock_expected(spec, cfg.engine.kernels))
        return plan_cache(cfg.engine, model, available_memory(), spec.max_position_embeddings)
    except MemoryBudgetError as exc:
        raise ConfigFileError(f"{cfg.path}: {MEMORY_KEY}: {exc}") from None


def _check_windows(cfg: ServerConfig, max_position_embeddings: int | None) -> None:
    """The engine's own shape rules (``backends.mindspore.shapes.plan_shapes``) against the model."""
    try:
        plan_shapes(cfg.engine, max_position_embeddings)
    except ShapeError as exc:
        raise ConfigFileError(f"{cfg.path}: {schedule_key(exc)}") from None


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
