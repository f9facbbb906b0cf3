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
from backends.settings import EngineConfig, LoraModuleConfig, LoraSettings, SpeculationSettings, prefill_chunk
from service.errors import ValidationError
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
    name: str
    weight_path: Path
    backend_type: str = "ms"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    path: Path
    server: ServerSettings
    model: ModelSettings
    engine: EngineConfig


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


def _resolve(base: Path, value: str | None) -> Path | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path)


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
    ca_dir = _resolve(base, s["tlsCaPath"]) or base
    return ServerSettings(
        ip_address=s["ipAddress"], port=s["port"], management_ip_address=s["managementIpAddress"],
        management_port=s["managementPort"], metrics_port=s["metricsPort"],
        allow_all_zero_ip_listening=s["allowAllZeroIpListening"], https_enabled=s["httpsEnabled"],
        tls_cert=_resolve(base, s["tlsCert"]), tls_pk=_resolve(base, s["tlsPk"]),
        tls_ca_files=tuple(_resolve(ca_dir, f) for f in ([ca] if isinstance(ca, str) else ca)),
        max_link_num=s["maxLinkNum"], full_text_enabled=s["fullTextEnabled"],
        playground_enabled=s["playgroundEnabled"],
        tool_call_format=s["toolCallFormat"], reasoning_format=s["reasoningFormat"],
        model_tool_call_formats=tuple((m["modelName"], m["toolCallFormat"])
                                      for m in data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
                                      if m.get("toolCallFormat") is not None),
        token_timeout=float(s["tokenTimeout"]), e2e_timeout=float(s["e2eTimeout"]),
        max_request_bytes=int(s["maxRequestLength"]) * 1024 * 1024,
        token_id_format=s["tokenIdFormat"], shutdown_grace_period=float(s["shutdownGracePeriod"]),
        header_timeout=float(s["headerTimeout"]), body_timeout=float(s["bodyTimeout"]),
        keep_alive_timeout=float(s["keepAliveTimeout"]), max_header_bytes=int(s["maxHeaderBytes"]),
        max_reading_requests=int(s["maxReadingRequests"]),
        max_buffered_body_bytes=int(s["maxBufferedBodyMB"]) * 1024 * 1024, listen_backlog=int(s["listenBacklog"]),
        media_root=s["mediaRoot"], max_media_loads=int(s["maxMediaLoads"]),
        max_media_buffer_bytes=int(s["maxMediaBufferMB"]) * 1024 * 1024, api_key=s["apiKey"],
    )


_DEPLOY = "BackendConfig.ModelDeployConfig"


def _lora(deploy: ServerSection, base: Path) -> LoraSettings:
    """LoraModules and the LoRA keys, checked across entries: unique names, a served baseModelName, a
    loraRoot with runtime updates. ValueError naming the key, the entry and the value."""
    served = [m["modelName"] for m in deploy["ModelConfig"]]
    modules, seen = [], {}
    for i, entry in enumerate(deploy["LoraModules"] or []):
        key = f"{_DEPLOY}.LoraModules[{i}]"
        if entry["name"] in seen:
            raise ValueError(f"{key}.name {entry['name']!r} is already the name of LoraModules[{seen[entry['name']]}]; "
                             "adapter names must be unique")
        if entry["baseModelName"] not in served:
            raise ValueError(f"{key}.baseModelName {entry['baseModelName']!r} is not a served model "
                             f"(ModelConfig modelName: {', '.join(map(repr, served))})")
        seen[entry["name"]] = i
        modules.append(LoraModuleConfig(entry["name"], _resolve(base, entry["path"])))
    runtime, root = bool(deploy["allowRuntimeLoraUpdating"]), _resolve(base, deploy["loraRoot"])
    if runtime and root is None:
        raise ValueError(f"{_DEPLOY}.allowRuntimeLoraUpdating is true but {_DEPLOY}.loraRoot is not set: runtime "
                         "loads are taken only from under that directory")
    lora = LoraSettings(modules=tuple(modules), max_loras=deploy["maxLoras"], max_rank=deploy["maxLoraRank"],
                        runtime_updates=runtime, root=root, max_loaded=deploy["maxLoadedLoras"])
    if lora.max_loaded and lora.max_loaded < len(modules):
        raise ValueError(f"{_DEPLOY}.maxLoadedLoras {lora.max_loaded} is fewer than the {len(modules)} LoraModules")
    return lora


def _engine(data: dict, base: Path) -> EngineConfig:
    deploy = ServerSection("ModelDeployConfig", data["BackendConfig"].get("ModelDeployConfig"))
    model = ServerSection("ModelConfig", deploy["ModelConfig"][0])
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
        lora=_lora(deploy, base), kernels=deploy["kernels"], kernel_isa=deploy["kernelIsa"],
        graph_cache=deploy["graphCache"], map_kv_cache=deploy["mapKvCache"], threads=deploy["threads"],
        speculation=_speculation(deploy, model, base),
    )


# plugin_params keys of the speculative plugin types: (default, lowest, highest); dynamic_algo is a boolean,
# draft_model_path a directory (draft_model's, required)
_PLUGIN_INTS = {"decoding_length": (8, 1, 64), "ngram_min": (2, 1, 8), "ngram_max": (3, 1, 8)}
_PLUGIN_KEYS = {"memory_decoding": ("decoding_length", "dynamic_algo", "ngram_min", "ngram_max"),
                "draft_model": ("decoding_length", "dynamic_algo", "draft_model_path")}


def _speculation(deploy: ServerSection, model: ServerSection, base: Path) -> SpeculationSettings:
    """ModelConfig plugin_params (the reference server's JSON string) and speculationGamma -> the speculative
    decoding settings; without plugin_params, speculationGamma > 0 alone is memory_decoding with that
    decoding_length (0: off). plugin_type draft_model (mindserve) drafts with the model at draft_model_path
    (relative: to the config file). ValueError naming the key and the value."""
    key, raw, gamma = f"{_DEPLOY}.ModelConfig[0].plugin_params", model["plugin_params"], deploy["speculationGamma"]
    if not raw:
        return SpeculationSettings(max_draft=gamma)
    try:
        params = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{key} {raw!r} is not a JSON object: {exc}") from None
    if not isinstance(params, dict) or params.get("plugin_type") not in _PLUGIN_KEYS:
        kind = params.get("plugin_type") if isinstance(params, dict) else params
        raise ValueError(f"{key} plugin_type {kind!r} is not supported: mindserve runs \"memory_decoding\" "
                         "(prompt-lookup speculative decoding) and \"draft_model\" (a draft model's proposals)")
    kind = params["plugin_type"]
    unknown = sorted(set(params) - {"plugin_type", *_PLUGIN_KEYS[kind]})
    if unknown:
        raise ValueError(f"{key} has the unknown key {unknown[0]!r} ({kind} takes {', '.join(_PLUGIN_KEYS[kind])})")
    ints = {}
    for name, (default, low, high) in _PLUGIN_INTS.items():
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{key} {name} {value!r} must be an integer in [{low}, {high}]")
        ints[name] = value
    adaptive = params.get("dynamic_algo", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"{key} dynamic_algo {adaptive!r} must be true or false")
    if ints["ngram_min"] > ints["ngram_max"]:
        raise ValueError(f"{key} ngram_min {ints['ngram_min']} must be <= ngram_max {ints['ngram_max']}")
    if gamma and gamma < ints["decoding_length"]:
        raise ValueError(f"{_DEPLOY}.speculationGamma {gamma} must be >= plugin_params decoding_length "
                         f"{ints['decoding_length']}")
    draft = None
    if kind == "draft_model":
        path = params.get("draft_model_path")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{key} draft_model_path {path!r} must name the draft model's directory "
                             "(plugin_type draft_model needs it)")
        draft = _resolve(base, path)
    return SpeculationSettings(max_draft=ints["decoding_length"], ngram_min=ints["ngram_min"],
                               ngram_max=ints["ngram_max"], adaptive=adaptive, draft_model=draft)


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
    model = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    model_cfg = ServerSection("ModelConfig", model)
    base = path.resolve().parent
    try:
        config = ServerConfig(
            path=path, server=_server(data, base),
            model=ModelSettings(model["modelName"], _resolve(base, model["modelWeightPath"]), model_cfg["backendType"]),
            engine=_engine(data, base),
        )
        check_engine(config.engine)
        check_listeners(config.server)
    except ValueError as exc:
        raise ConfigFileError(f"{label}: {exc}") from None
    return config
