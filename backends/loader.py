"""The one door from ``service/`` into a backend: build the backend a server config names, check its model
directory before anything is loaded, prepare the default model, convert a GGUF file, the model cache (a MODEL
reference resolved, fetched and converted; listed; removed), and the config-only shape rules. Imports the heavy
framework only when a backend is built."""
from __future__ import annotations

from pathlib import Path

from backends.base import Backend
from backends.mindspore.preflight import (ADAPTERS, KV_CACHE, MEMORY, MODEL, SCHEDULE, SPECULATION, ModelCheck,
                                          PreflightError, is_default_model, is_model_dir)
from backends.mindspore.model_cache_index import CachedModel, cached_models, downloads_size, remove_models
from backends.mindspore.model_sources import ModelSource, ModelSourceError, SourceKind, resolve_source
from backends.mindspore.model_store import ModelStore, ModelStoreError
from backends.mindspore.model_store import default_root as default_models_root
from backends.mindspore.shapes import ShapeError, check_buckets
from backends.settings import EngineConfig

__all__ = ["ADAPTERS", "KV_CACHE", "MEMORY", "MODEL", "SCHEDULE", "SPECULATION", "CachedModel", "ModelCheck",
           "ModelSource", "ModelSourceError", "ModelStore", "ModelStoreError", "PreflightError", "ShapeError",
           "SourceKind", "cached_models", "check_backend", "check_backends", "check_buckets", "convert_gguf",
           "default_model_dtype", "default_models_root", "downloads_size", "is_default_model", "is_model_dir",
           "load_backend", "prepare_default_model", "remove_models", "resolve_source"]


def _backend(backend_type: str) -> None:
    if backend_type != "ms":
        raise ValueError(f"backendType {backend_type!r} is not supported; use \"ms\"")


def load_backend(backend_type: str, model_dir: Path, config: EngineConfig, *, model_name: str | None = None,
                 progress: bool = True) -> Backend:
    _backend(backend_type)
    from backends.mindspore.engine import Engine

    return Engine(model_dir, config, warmup=True, progress=progress, model_name=model_name).start()


def check_backend(backend_type: str, model_dir: Path, config: EngineConfig) -> ModelCheck:
    """The backend's start-up checks on ``model_dir`` (no weights loaded); PreflightError naming what is at
    fault."""
    _backend(backend_type)
    from backends.mindspore.preflight import check_model

    return check_model(model_dir, config)


def check_backends(models: list[tuple[str, Path, EngineConfig]], resident: int) -> list[ModelCheck]:
    """``check_backend`` of every model of one server, the memory budget covering the ``resident`` models that
    may be loaded at once (``backends/mindspore/preflight.py check_models``); PreflightError's ``index`` names
    the model at fault."""
    for backend_type, _, _ in models:
        _backend(backend_type)
    from backends.mindspore.preflight import check_models

    return check_models([(path, config) for _, path, config in models], resident)


def default_model_dtype(path: Path) -> str:
    """The convert-gguf --dtype the default model directory ``path`` holds."""
    from backends.mindspore.default_model import DEFAULT_DIRS

    return DEFAULT_DIRS[path.name]


def prepare_default_model(path: Path) -> Path:
    """Download and convert the default model into ``path`` (a default model directory) if it is not there."""
    from backends.mindspore.default_model import ensure_default_model

    return ensure_default_model(path.parent, name=path.name)


def convert_gguf(gguf: Path, out: Path, **options) -> Path:
    """A GGUF file -> a model directory (``backends/mindspore/gguf_convert.py``)."""
    from backends.mindspore.gguf_convert import convert_gguf as convert

    return convert(gguf, out, **options)
