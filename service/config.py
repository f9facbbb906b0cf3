"""The server configuration file (YAML or the reference server's config.json) -> frozen settings."""
from __future__ import annotations

import functools
import ipaddress
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from backends.loader import ShapeError, check_buckets
from backends.settings import EngineConfig, prefill_chunk
from service.errors import ValidationError
from service.model_config import DEPLOY as _DEPLOY
from service.model_config import lora_settings, resolve, speculation_settings
from service.validation import default_schemas

MAX_CONFIG_BYTES = 10 * 1024 * 1024  # the reference server's limit


class ConfigFileError(ValueError):
    """The server config cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """``ServerConfig`` as the server applies it. The defaults equal the schema's ``default``s (a test
    checks it); ``load_server_config`` takes its defaults from the schema itself."""

    ip_address: str = "127.0.0.1"
    port: int = 1025
    management_ip_address: str | None = None  # None: ip_address
    management_port: int | None = None  # None: port
    metrics_port: int | None = None  # None: port
    allow_all_zero_ip_listening: bool = False
    https_enabled: bool = False
    tls_cert: Path | None = None
    tls_pk: Path | None = None
    tls_ca_files: tuple[Path, ...] = ()
    max_link_num: int = 1000
    full_text_enabled: bool = False
    playground_enabled: bool = True  # the browser page at /playground and a browser's GET / (service/playground.py)
    tool_call_format: str = "auto"  # how chat output's tool calls are read (backends/chat_format.py)
    reasoning_format: str = "auto"  # whether chat output's <think> block is reasoning_content
    model_tool_call_formats: tuple[tuple[str, str], ...] = ()  # (modelName, its ModelConfig toolCallFormat)
    token_timeout: float = 600.0
    e2e_timeout: float = 600.0
    max_request_bytes: int = 40 * 1024 * 1024
    token_id_format: str = "list"
    owned_by: str = "mindserve"  # /v1/models' owned_by: what a gateway classifies the worker by
    shutdown_grace_period: float = 30.0  # seconds in-flight requests get to finish after SIGTERM/SIGINT
    # What a client controls about its connection (service/connections.py, service/http.py)
    header_timeout: float = 10.0  # a request head must be complete within this of its first byte
    body_timeout: float = 60.0  # a request body must be complete within this of its head
    keep_alive_timeout: float = 30.0  # an idle connection between two requests is closed after this
    max_header_bytes: int = 65536  # a larger request head is answered 431
    max_reading_requests: int = 1000  # requests reading their body at once; beyond, 429 at once
    max_buffered_body_bytes: int = 256 * 1024 * 1024  # body bytes those requests may hold in all; beyond, 503
    listen_backlog: int = 1024  # connections the kernel queues before the server accepts them
    # Media parts of requests (service/media/, docs/multimodal.md)
    media_root: str = "/data/multimodal_inputs/"  # local media files must be under it
    max_media_loads: int = 8  # requests loading media at once; beyond, 429 at once
    max_media_buffer_bytes: int = 2048 * 1024 * 1024  # media bytes requests may hold at once; beyond, 429
    api_key: str | None = field(default=None, repr=False)  # business routes want it (service/auth.py); never shown

    def chat_formats(self, model: str) -> tuple[str, str]:
        """(toolCallFormat, reasoningFormat) of ``model``: its ModelConfig entry's toolCallFormat when set,
        else ServerConfig's."""
        return dict(self.model_tool_call_formats).get(model, self.tool_call_format), self.reasoning_format

    @property
    def management_address(self) -> str:
        """Where the management and metrics planes listen."""
        return self.management_ip_address or self.ip_address


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """One ``ModelConfig`` entry: the model and the engine that serves it (its own keys, the shared
    ``ModelDeployConfig``/``ScheduleConfig`` ones and the LoraModules whose baseModelName it is)."""

    name: str
    weight_path: Path
    backend_type: str = "ms"
    engine: EngineConfig = EngineConfig()
    index: int = 0  # its place in ModelConfig, for the keys errors name

    @property
    def key(self) -> str:
        return f"{_DEPLOY}.ModelConfig[{self.index}]"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    path: Path
    server: ServerSettings
    models: tuple[ModelSettings, ...]  # every ModelConfig entry, in order; names unique
    max_loaded_models: int = 0  # ModelDeployConfig.maxLoadedModels: models resident at once; 0 = all

    @property
    def model(self) -> ModelSettings:
        """The first model: the one ``POST /`` and the TGI routes serve."""
        return self.models[0]

    @property
    def engine(self) -> EngineConfig:
        """The first model's engine."""
        return self.models[0].engine

    @property
    def resident_models(self) -> int:
        """How many models may be loaded at once."""
        return min(self.max_loaded_models or len(self.models), len(self.models))


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigFileError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = json.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping")
    return data


@functools.cache
def schema_defaults() -> dict[str, dict[str, Any]]:
    """``{section: {key: default}}`` from the ``default`` keywords of ``schemas/server_config.schema.json``:
    the one place the defaults are written down."""
    defs = default_schemas().schema("server_config")["$defs"]
    return {section: {key: prop["default"] for key, prop in defs[section]["properties"].items() if "default" in prop}
            for section in _SECTIONS}


_SECTIONS = ("ServerConfig", "ModelDeployConfig", "ModelConfig", "ScheduleConfig")


class ServerSection:
    """One section of the file; a key it lacks reads as the schema's default (None without one)."""

    def __init__(self, name: str, data: dict | None) -> None:
        self.data, self.defaults = data or {}, schema_defaults()[name]

    def __getitem__(self, key: str) -> Any:
        value = self.data.get(key)
        return self.defaults.get(key) if value is None else value


def _server(data: dict, base: Path) -> ServerSettings:
    s = ServerSection("ServerConfig", data.get("ServerConfig"))
    ca = s["tlsCaFile"] or []
    ca_dir = resolve(base, s["tlsCaPath"]) or base
    return ServerSettings(
        ip_address=s["ipAddress"], port=s["port"], management_ip_address=s["managementIpAddress"],
        management_port=s["managementPort"], metrics_port=s["metricsPort"],
        allow_all_zero_ip_listening=s["allowAllZeroIpListening"], https_enabled=s["httpsEnabled"],
        tls_cert=resolve(base, s["tlsCert"]), tls_pk=resolve(base, s["tlsPk"]),
        tls_ca_files=tuple(resolve(ca_dir, f) for f in ([ca] if isinstance(ca, str) else ca)),
        max_link_num=s["maxLinkNum"], full_text_enabled=s["fullTextEnabled"],
        playground_enabled=s["playgroundEnabled"],
        tool_call_format=s["toolCallFormat"], reasoning_format=s["reasoningFormat"],
        model_tool_call_formats=tuple((m["modelName"], m["toolCallFormat"])
                                      for m in data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
                                      if m.get("toolCallFormat") is not None),
        token_timeout=float(s["tokenTimeout"]), e2e_timeout=float(s["e2eTimeout"]),
        max_request_bytes=int(s["maxRequestLength"]) * 1024 * 1024,
        token_id_format=s["tokenIdFormat"], owned_by=s["ownedBy"],
        shutdown_grace_period=float(s["shutdownGracePeriod"]),
        header_timeout=float(s["headerTimeout"]), body_timeout=float(s["bodyTimeout"]),
        keep_alive_timeout=float(s["keepAliveTimeout"]), max_header_bytes=int(s["maxHeaderBytes"]),
        max_reading_requests=int(s["maxReadingRequests"]),
        max_buffered_body_bytes=int(s["maxBufferedBodyMB"]) * 1024 * 1024, listen_backlog=int(s["listenBacklog"]),
        media_root=s["mediaRoot"], max_media_loads=int(s["maxMediaLoads"]),
        max_media_buffer_bytes=int(s["maxMediaBufferMB"]) * 1024 * 1024, api_key=s["apiKey"],
    )


def _engine(data: dict, base: Path, index: int = 0) -> EngineConfig:
    """The engine of ModelConfig[``index``]: its own keys and the shared ModelDeployConfig/ScheduleConfig ones."""
    deploy = ServerSection("ModelDeployConfig", data["BackendConfig"].get("ModelDeployConfig"))
    model = ServerSection("ModelConfig", deploy["ModelConfig"][index])
    sched = ServerSection("ScheduleConfig", data["BackendConfig"].get("ScheduleConfig"))
    truncation = deploy["truncation"]
    buckets = {k: tuple(sorted(sched[k])) if sched[k] else None for k in ("batchBuckets", "windowBuckets")}
    return EngineConfig(
        max_seq_len=deploy["maxSeqLen"], max_input_tokens=deploy["maxInputTokenLen"],
        truncation=int(truncation) if not isinstance(truncation, bool) else (-1 if truncation else 0),
        max_batch_size=sched["maxBatchSize"], max_iter_times=sched["maxIterTimes"],
        block_size=sched["cacheBlockSize"], prefill_chunk=prefill_chunk(sched["maxPrefillTokens"]),
        max_prefill_batch=sched["maxPrefillBatchSize"], max_prefill_tokens=sched["maxPrefillTokens"],
        batch_buckets=buckets["batchBuckets"], window_buckets=buckets["windowBuckets"],
        cache_gb=float(model["npuMemSize"]), kv_cache_dtype=model["kvCacheDtype"],
        prefix_caching=sched["enablePrefixCaching"],
        lora=lora_settings(deploy, base, index), kernels=deploy["kernels"], kernel_isa=deploy["kernelIsa"],
        graph_cache=deploy["graphCache"], map_kv_cache=deploy["mapKvCache"], threads=deploy["threads"],
        speculation=speculation_settings(deploy, model, base, index),
    )


def _models(data: dict, base: Path) -> tuple[ModelSettings, ...]:
    """Every ModelConfig entry with its engine; a modelName used twice is a ValueError naming both entries."""
    entries, seen, models = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"], {}, []
    for i, entry in enumerate(entries):
        name = entry["modelName"]
        if name in seen:
            raise ValueError(f"{_DEPLOY}.ModelConfig[{i}].modelName {name!r} is already the modelName of "
                             f"ModelConfig[{seen[name]}]; model names must be unique")
        seen[name] = i
        backend_type = ServerSection("ModelConfig", entry)["backendType"]
        models.append(ModelSettings(name, resolve(base, entry["modelWeightPath"]), backend_type,
                                    _engine(data, base, i), i))
    return tuple(models)


_SCHEDULE = "BackendConfig.ScheduleConfig"


def check_engine(engine: EngineConfig) -> None:
    """Rules across keys, on the values applied (defaults included); raises ValueError naming the key."""
    if engine.max_prefill_batch > engine.max_batch_size:
        raise ValueError(f"{_SCHEDULE}.maxPrefillBatchSize {engine.max_prefill_batch} must be <= "
                         f"maxBatchSize {engine.max_batch_size}")
    if engine.max_iter_times > engine.max_seq_len:
        raise ValueError(f"{_SCHEDULE}.maxIterTimes {engine.max_iter_times} must be <= "
                         f"BackendConfig.ModelDeployConfig.maxSeqLen {engine.max_seq_len}")
    try:
        check_buckets(engine)  # the backend's own rules; the window coverage needs the model (preflight)
    except ShapeError as exc:
        raise ValueError(schedule_key(exc)) from None


def schedule_key(exc: ShapeError) -> str:
    """A bucket error with the server config's section in front of the key it names."""
    return f"{_SCHEDULE}.{exc}"


def check_listeners(server: ServerSettings) -> None:
    """Unspecified listen addresses need allowAllZeroIpListening; no two planes may want one socket; one
    whole body must fit in what bodies being read may hold."""
    if server.max_buffered_body_bytes < server.max_request_bytes:
        raise ValueError(f"ServerConfig.maxBufferedBodyMB {server.max_buffered_body_bytes >> 20} must be >= "
                         f"maxRequestLength {server.max_request_bytes >> 20}: one whole body must fit")
    for key, address in (("ipAddress", server.ip_address), ("managementIpAddress", server.management_ip_address)):
        if address is not None and _unspecified(address) and not server.allow_all_zero_ip_listening:
            raise ValueError(f"ServerConfig.{key} {address} listens on every network interface; set "
                             f"ServerConfig.allowAllZeroIpListening: true to allow that, or give one address")
    listeners = list(planes_by_listener(server))
    for i, (address, port) in enumerate(listeners):
        for other, other_port in listeners[i + 1:]:
            if port and port == other_port and (_unspecified(address) or _unspecified(other)):
                raise ValueError(f"ServerConfig: port {port} is wanted on {address} and on {other}; an "
                                 f"address that listens on every interface cannot share a port with another "
                                 f"address: give managementPort/metricsPort their own ports")


def _unspecified(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_unspecified
    except ValueError:  # "localhost"
        return False


BUSINESS, MANAGEMENT, METRICS = "business", "management", "metrics"


def planes_by_listener(settings: ServerSettings) -> dict[tuple[str, int], frozenset[str]]:
    """The planes each (address, port) serves, the business listener first. The management and metrics
    planes listen on ``management_address``; an unset port is ``port``, and planes at one (address, port)
    share one server."""
    def port_of(value: int | None) -> int:
        return settings.port if value is None else value

    grouped: dict[tuple[str, int], set[str]] = {}
    for plane, address, port in (
            (BUSINESS, settings.ip_address, settings.port),
            (MANAGEMENT, settings.management_address, port_of(settings.management_port)),
            (METRICS, settings.management_address, port_of(settings.metrics_port))):
        grouped.setdefault((address, port), set()).add(plane)
    return {listener: frozenset(planes) for listener, planes in grouped.items()}


def with_port(config: ServerConfig, port: int) -> ServerConfig:
    """``config`` with the business port replaced (``serve --port``), checked again."""
    config = replace(config, server=replace(config.server, port=port))
    try:
        check_listeners(config.server)
    except ValueError as exc:
        raise ConfigFileError(f"{config.path} with --port {port}: {exc}") from None
    return config


def load_server_config(path: Path | str) -> ServerConfig:
    """Read, schema-check and convert a server config, then check the rules across keys; raises
    ConfigFileError naming the file and the key. Checks that need other files are in ``preflight``."""
    path = Path(path)
    return server_config_from_data(read_config_file(path), path)


def server_config_from_data(data: dict[str, Any], path: Path, *, label: str | None = None) -> ServerConfig:
    """A config already read into ``data`` (``read_config_file``, maybe with the command line's overrides
    applied: ``service/serve_args.py``), checked and converted as ``load_server_config`` does; relative paths
    resolve against ``path``'s directory, and errors name ``label`` (default: ``path``)."""
    label = label or str(path)
    try:
        default_schemas().validate("server_config", data, root="config")
    except ValidationError as exc:
        raise ConfigFileError(f"{label}: {exc.message}") from None
    base = path.resolve().parent
    deploy = ServerSection("ModelDeployConfig", data["BackendConfig"]["ModelDeployConfig"])
    try:
        config = ServerConfig(path=path, server=_server(data, base), models=_models(data, base),
                              max_loaded_models=deploy["maxLoadedModels"])
        for model in config.models:
            check_engine(model.engine)
        check_listeners(config.server)
    except ValueError as exc:
        raise ConfigFileError(f"{label}: {exc}") from None
    return config
