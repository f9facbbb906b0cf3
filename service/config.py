"""The server configuration file (YAML or the reference server's config.json) -> frozen settings."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from backends.settings import EngineConfig
from service.errors import ValidationError
from service.validation import default_schemas

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_CONFIG_BYTES = 10 * 1024 * 1024  # the reference server's limit


class ConfigFileError(ValueError):
    """The server config cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class ServerSettings:
    ip_address: str = "127.0.0.1"
    port: int = 1025
    management_port: int | None = None
    metrics_port: int | None = None
    https_enabled: bool = False
    tls_cert: Path | None = None
    tls_pk: Path | None = None
    tls_ca_files: tuple[Path, ...] = ()
    max_link_num: int = 1000
    full_text_enabled: bool = False
    token_timeout: float = 600.0
    e2e_timeout: float = 600.0
    max_request_bytes: int = 40 * 1024 * 1024
    token_id_format: str = "list"
    shutdown_grace_period: float = 30.0  # seconds in-flight requests get to finish after SIGTERM/SIGINT


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


def _server(data: dict, base: Path) -> ServerSettings:
    s = data.get("ServerConfig") or {}
    ca = s.get("tlsCaFile") or []
    ca_dir = _resolve(base, s.get("tlsCaPath")) or base
    return ServerSettings(
        ip_address=s.get("ipAddress", "127.0.0.1"), port=s.get("port", 1025),
        management_port=s.get("managementPort"), metrics_port=s.get("metricsPort"),
        https_enabled=s.get("httpsEnabled", False),
        tls_cert=_resolve(base, s.get("tlsCert")), tls_pk=_resolve(base, s.get("tlsPk")),
        tls_ca_files=tuple(_resolve(ca_dir, f) for f in ([ca] if isinstance(ca, str) else ca)),
        max_link_num=s.get("maxLinkNum", 1000), full_text_enabled=s.get("fullTextEnabled", False),
        token_timeout=float(s.get("tokenTimeout", 600)), e2e_timeout=float(s.get("e2eTimeout", 600)),
        max_request_bytes=int(s.get("maxRequestLength", 40)) * 1024 * 1024,
        token_id_format=s.get("tokenIdFormat", "list"),
        shutdown_grace_period=float(s.get("shutdownGracePeriod", 30)),
    )


def _engine(data: dict, path: Path) -> EngineConfig:
    deploy = data["BackendConfig"].get("ModelDeployConfig") or {}
    sched = data["BackendConfig"].get("ScheduleConfig") or {}
    max_seq = deploy.get("maxSeqLen", 2560)
    max_batch = sched.get("maxBatchSize", 200)
    if sched.get("maxPrefillBatchSize", 1) > max_batch:
        raise ConfigFileError(f"{path}: BackendConfig.ScheduleConfig.maxPrefillBatchSize "
                              f"{sched['maxPrefillBatchSize']} must be <= maxBatchSize {max_batch}")
    if sched.get("maxIterTimes", 1) > max_seq:
        raise ConfigFileError(f"{path}: BackendConfig.ScheduleConfig.maxIterTimes {sched['maxIterTimes']} "
                              f"must be <= maxSeqLen {max_seq}")
    truncation = deploy.get("truncation", 0)
    buckets = {k: tuple(sorted(sched[k])) for k in ("batchBuckets", "windowBuckets") if k in sched}
    return EngineConfig(
        max_seq_len=max_seq, max_input_tokens=deploy.get("maxInputTokenLen", 2048),
        truncation=int(truncation) if not isinstance(truncation, bool) else (-1 if truncation else 0),
        max_batch_size=max_batch, max_iter_times=sched.get("maxIterTimes", 512),
        block_size=sched.get("cacheBlockSize", 128),
        prefill_chunk=min(sched.get("maxPrefillTokens", 64), 64),
        max_prefill_batch=sched.get("maxPrefillBatchSize", 4), max_prefill_tokens=sched.get("maxPrefillTokens", 256),
        batch_buckets=buckets.get("batchBuckets"), window_buckets=buckets.get("windowBuckets"),
    )


def load_server_config(path: Path | str) -> ServerConfig:
    """Read, schema-check and convert a server config; raises ConfigFileError naming the key."""
    path = Path(path)
    data = read_config_file(path)
    try:
        default_schemas().validate("server_config", data, root="config")
    except ValidationError as exc:
        raise ConfigFileError(f"{path}: {exc.message}") from None
    model = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    base = path.resolve().parent
    return ServerConfig(
        path=path, server=_server(data, base),
        model=ModelSettings(model["modelName"], _resolve(base, model["modelWeightPath"]),
                            model.get("backendType", "ms")),
        engine=_engine(data, path),
    )
