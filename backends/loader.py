"""Build the backend a server config names (imports the heavy framework only when called)."""
from __future__ import annotations

from pathlib import Path

from backends.base import Backend
from backends.settings import EngineConfig


def load_backend(backend_type: str, model_dir: Path, config: EngineConfig, *, model_name: str | None = None,
                 progress: bool = True) -> Backend:
    if backend_type != "ms":
        raise ValueError(f"backendType {backend_type!r} is not supported; use \"ms\"")
    from backends.mindspore.engine import Engine

    return Engine(model_dir, config, warmup=True, progress=progress, model_name=model_name).start()
