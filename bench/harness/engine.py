"""The one way a measurement builds an engine or a bare runner: bench's one door into the backend's real names."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.harness.paths import CACHE_DIR

DEFAULT_MODELS = CACHE_DIR


def default_model_dir(cache: Path = DEFAULT_MODELS, progress: bool = False) -> Path:
    """The default model's fp32 conversion (made from its GGUF the first time, as the tests' is)."""
    from backends.mindspore.sources.default_model import ensure_default_model

    return ensure_default_model(cache, progress=progress)


def engine(model_dir: Path | None = None, *, warmup: bool = True, progress: bool = False, **config: Any):
    """An ``Engine`` (not started: ``with engine(...) as e`` or ``.start()``) on ``model_dir`` (default: the
    default model), ``config`` being ``EngineConfig``'s fields."""
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    return Engine(model_dir or default_model_dir(), EngineConfig(**config), warmup=warmup, progress=progress)


def runner(model_dir: Path | None = None, *, num_blocks: int, kernels: str = "aot", threads: int = 2,
           lora: tuple[int, int] | None = None, kv_dtype: str = "float32", **shapes: Any):
    """A bare ``ModelRunner`` (no engine, no scheduler): the model's weights in a runner for ``kernels``, on the
    CPU with ``threads`` threads, its graphs compiled for ``Shapes(**shapes)``."""
    from backends.mindspore.families import load_model
    from backends.mindspore.planning.device import set_mode
    from backends.mindspore.runners import build_runner
    from backends.mindspore.planning.shapes import Shapes
    from backends.mindspore.modeldir.weights import load_weights

    spec = load_model(model_dir or default_model_dir())
    set_mode(0, "CPU", threads)
    return build_runner(spec, load_weights(spec.checkpoint, spec.checkpoint_format), Shapes(**shapes), num_blocks,
                        kernels, lora=lora, kv_dtype=kv_dtype)
