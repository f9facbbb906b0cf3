"""The one door from ``service/`` into a backend: build the backend a server config names, check its model
directory before anything is loaded, prepare the default model, convert a GGUF file, the model cache (a MODEL
reference resolved, fetched and converted; listed; removed), and the config-only shape rules. Imports the heavy
framework only when a backend is built."""
from __future__ import annotations

import threading
from pathlib import Path

from backends.base import Backend
from backends.mindspore.engine.preflight import (ADAPTERS, KV_CACHE, MEMORY, MODEL, SCHEDULE, SPECULATION, ModelCheck,
                                                   PreflightError, is_default_model, is_model_dir)
from backends.mindspore.sources.model_cache_index import CachedModel, cached_models, downloads_size, remove_models
from backends.mindspore.sources.model_sources import ModelSource, ModelSourceError, SourceKind, resolve_source
from backends.mindspore.sources.model_store import ModelStore, ModelStoreError
from backends.mindspore.sources.model_store import default_root as default_models_root
from backends.mindspore.planning.shapes import ShapeError, check_buckets
from backends.settings import EngineConfig

__all__ = ["ADAPTERS", "KV_CACHE", "MEMORY", "MODEL", "SCHEDULE", "SPECULATION", "CachedModel", "ModelCheck",
           "ModelSource", "ModelSourceError", "ModelStore", "ModelStoreError", "PreflightError", "ShapeError",
           "SourceKind", "cached_models", "check_backend", "check_backends", "check_buckets", "convert_gguf",
           "default_model_dtype", "default_models_root", "downloads_size", "is_default_model", "is_model_dir",
           "load_backend", "preload_backend", "prepare_default_model", "remove_models", "resolve_source"]


def _backend(backend_type: str) -> None:
    if backend_type != "ms":
        raise ValueError(f"backendType {backend_type!r} is not supported; use \"ms\"")


def load_backend(backend_type: str, model_dir: Path, config: EngineConfig, *, model_name: str | None = None,
                 progress: bool = True, checked: ModelCheck | None = None) -> Backend:
    """The backend of ``model_dir``, loaded and warmed up; ``checked``: ``check_backend``'s result, whose
    tokenizer the engine takes over if it was read from ``model_dir`` (parsed once per start)."""
    _backend(backend_type)
    from backends.mindspore.engine.engine import Engine

    return Engine(model_dir, config, warmup=True, progress=progress, model_name=model_name,
                  tokenizer=checked.tokenizer if checked is not None else None).start()


def preload_backend() -> threading.Thread:
    """Start importing the engine's modules, MindSpore with them, in a thread, and return it. ``serve`` calls it
    first thing: the import (seconds of a start from the caches, much of it reading and mapping shared libraries,
    which lets the GIL go) runs while the config, the model check and the HTTP side load; ``load_backend`` then finds
    the modules imported, or waits for the import in progress (Python's import lock). A failure here is left for
    ``load_backend``'s own import to raise, where start-up reports it. The caller joins the thread before the
    process exits (a config error): finalizing the interpreter during the import aborts it (the import, cut short by
    the shutdown, leaves MindSpore half-imported with its atexit hook registered)."""
    def run() -> None:
        try:
            import backends.mindspore.engine.engine  # noqa: F401 - what load_backend imports
        except BaseException:  # noqa: BLE001, S110 - load_backend imports it again and reports the error
            pass

    thread = threading.Thread(target=run, name="mindserve-preload", daemon=True)
    thread.start()
    return thread


def check_backend(backend_type: str, model_dir: Path, config: EngineConfig) -> ModelCheck:
    """The backend's start-up checks on ``model_dir`` (no weights loaded); PreflightError naming what is at
    fault."""
    _backend(backend_type)
    from backends.mindspore.engine.preflight import check_model

    return check_model(model_dir, config)


def check_backends(models: list[tuple[str, Path, EngineConfig]], resident: int) -> list[ModelCheck]:
    """``check_backend`` of every model of one server, the memory budget covering the ``resident`` models that
    may be loaded at once (``backends/mindspore/engine/preflight.py check_models``); PreflightError's ``index`` names
    the model at fault."""
    for backend_type, _, _ in models:
        _backend(backend_type)
    from backends.mindspore.engine.preflight import check_models

    return check_models([(path, config) for _, path, config in models], resident)


def default_model_dtype(path: Path) -> str:
    """The convert-gguf --dtype the default model directory ``path`` holds."""
    from backends.mindspore.sources.default_model import DEFAULT_DIRS

    return DEFAULT_DIRS[path.name]


def prepare_default_model(path: Path) -> Path:
    """Download and convert the default model into ``path`` (a default model directory) if it is not there."""
    from backends.mindspore.sources.default_model import ensure_default_model

    return ensure_default_model(path.parent, name=path.name)


def convert_gguf(gguf: Path, out: Path, **options) -> Path:
    """A GGUF file -> a model directory (``backends/mindspore/sources/gguf_convert.py``)."""
    from backends.mindspore.sources.gguf_convert import convert_gguf as convert

    return convert(gguf, out, **options)
