"""The MindSpore backend's start-up checks that read the model directory but load no weights: the yaml,
config.json, weights file and tokenizer, the window buckets against the model, the configured adapters and
the KV cache against the memory budget. No MindSpore import: ``backends/loader.py`` runs them for
``service/preflight.py``, which names the server config's key for each ``PreflightError``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from backends.mindspore.engine.adapters import ConfiguredAdapterError, EngineAdapters
from backends.mindspore.families import load_model
from backends.mindspore.sources.default_model import DEFAULT_DIRS
from backends.mindspore.planning.kernel_path import stock_expected
from backends.mindspore.planning.kv_dtype import KEY as KV_KEY, cache_dtype
from backends.mindspore.planning.memory import (GIB, Available, CachePlan, Footprint, MemoryBudgetError,
                                                available_memory, plan_cache)
from backends.mindspore.sources.model_sources import is_model_dir, is_model_source
from backends.mindspore.planning.shapes import ShapeError, plan_shapes
from backends.mindspore.modeldir.yaml_tree import ConfigError
from backends.settings import EngineConfig

if TYPE_CHECKING:
    from backends.mindspore.modeldir.tokenizer import Tokenizer

MODEL, MEMORY, SCHEDULE, ADAPTERS = "model", "memory", "schedule", "adapters"  # what a PreflightError is about
KV_CACHE = "kv_cache"  # kvCacheDtype
SPECULATION = "speculation"  # plugin_params draft_model_path


class PreflightError(ValueError):
    """A check failed. ``about`` says which setting is at fault (``MODEL``, ``MEMORY``, ``SCHEDULE``,
    ``ADAPTERS``, ``KV_CACHE``); ``detail`` is the text that follows that setting's key (from ``: ``, ``.`` or
    ``[i]``)."""

    def __init__(self, about: str, detail: str, index: int = 0) -> None:
        super().__init__(detail)
        self.about, self.detail, self.index = about, detail, index  # index: which model of ``check_models``


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """What the model directory holds (``None`` fields: the default model, not prepared yet)."""

    directory: Path
    arch: str | None = None
    max_position_embeddings: int | None = None
    cache: CachePlan | None = None  # the KV cache the engine would allocate now
    resident_bytes: int = 0  # what the model holds once loaded: weights, adapter slots, vision tower, cache
    # The tokenizer the check loaded, for the engine to take over (``load_backend(tokenizer=...)``) rather than
    # parse the same files again: seconds for a 262k vocabulary's 33 MB tokenizer.json.
    tokenizer: Tokenizer | None = None

    @property
    def prepared(self) -> bool:
        return self.arch is not None


def is_default_model(path: Path) -> bool:
    """``path`` names a default model directory that ``prepare_default_model`` makes on first use."""
    return path.name in DEFAULT_DIRS


def check_models(models: Sequence[tuple[Path, EngineConfig]], resident: int) -> list[ModelCheck]:
    """``check_model`` of each model of one server, at most ``resident`` of them loaded at once: each model's
    cache is planned with the memory the largest ``resident - 1`` models before it hold taken away, and a
    -1 budget (npuMemSize) of a model sharing the process gets at most 1/``resident`` of the memory free
    now. A PreflightError's ``index`` says which model failed."""
    available, held = available_memory(), []
    checks = []
    for i, (path, engine) in enumerate(models):
        others = sum(sorted(held, reverse=True)[:max(resident - 1, 0)])
        budget = available
        if others:
            budget = Available(available.bytes - others, f"{available.source} less {others / GIB:.2f} GiB held by "
                               "the models before it in ModelConfig that may be loaded beside it")
        if resident > 1 and engine.cache_gb <= 0 and available.bytes // resident < budget.bytes:
            budget = Available(available.bytes // resident, f"{available.source} / {resident} models loaded at once")
        try:
            checks.append(check_model(path, engine, budget))
        except PreflightError as exc:
            exc.index = i
            raise
        held.append(checks[-1].resident_bytes)
    return checks


def check_model(path: Path, engine: EngineConfig, available: Available | None = None) -> ModelCheck:
    """The model directory and everything the engine reads from it before loading weights. The default
    model's directory may be absent, and a GGUF, an HF directory or a package stand for one: serve prepares it.
    ``available``: the memory the model may take (default: what is free now)."""
    if not is_model_dir(path):
        if is_default_model(path) or is_model_source(path):  # serve prepares it, then the engine checks it
            _check_windows(engine, None)
            return ModelCheck(path)
        raise PreflightError(MODEL, f": {path} is not a model directory (no .yaml inside)")
    from backends.mindspore.modeldir.tokenizer import Tokenizer  # tokenizers: only once there is a model

    try:
        spec = load_model(path)
    except (ConfigError, OSError, ValueError) as exc:
        raise PreflightError(MODEL, f": {exc}") from None
    if not spec.checkpoint.exists():
        raise PreflightError(MODEL, f": weights {spec.checkpoint} not found (load_checkpoint in "
                                    f"{spec.yaml_path.name})")
    try:
        tokenizer = Tokenizer.from_model_dir(spec.model_dir, spec.tokenizer)
    except Exception as exc:  # noqa: BLE001 - tokenizers and mindformers raise plain exceptions
        raise PreflightError(MODEL, f": cannot load the tokenizer: {exc}") from None
    _check_windows(engine, spec.max_position_embeddings)
    adapters = _check_adapters(engine, spec)
    draft = _check_draft_model(engine, spec, tokenizer)
    cache, held = _check_memory(engine, spec, adapters, draft, available or available_memory())
    return ModelCheck(spec.model_dir, spec.arch, spec.max_position_embeddings, cache, held, tokenizer)


def _check_draft_model(engine: EngineConfig, target, target_tokenizer: Tokenizer):
    """The draft model of plugin_type draft_model (None without one): its directory read as the engine reads it,
    its tokenizer the target's (``target_tokenizer``; ``draft_model.check_tokenizer``), a text model reaching the
    target's window."""
    path = engine.speculation.draft_model
    if path is None:
        return None
    from backends.mindspore.engine.draft_model import KEY, DraftModelError, check_draft_spec, check_tokenizer
    from backends.mindspore.modeldir.tokenizer import Tokenizer

    try:
        spec = load_model(path)
        check_tokenizer(Tokenizer.from_model_dir(spec.model_dir, spec.tokenizer), target_tokenizer, spec.model_dir)
        check_draft_spec(spec, plan_shapes(engine, target.max_position_embeddings).max_window)
    except DraftModelError as exc:
        raise PreflightError(SPECULATION, str(exc).removeprefix(KEY)) from None
    except (ConfigError, OSError, ValueError) as exc:
        raise PreflightError(SPECULATION, f" {path}: {exc}") from None
    return spec


def _check_adapters(engine: EngineConfig, spec) -> EngineAdapters:
    """Every LoraModules adapter read and checked against the model, as the engine reads them
    (``EngineAdapters``): a bad one is an error naming its entry (the reference server warns and skips it;
    we refuse)."""
    try:
        return EngineAdapters(spec, engine.lora)
    except ConfiguredAdapterError as exc:
        raise PreflightError(ADAPTERS, f"[{exc.index}] ({exc.module.name}, path {exc.module.path}): {exc}") from None
    except ValueError as exc:  # a vision-language model with LoraModules
        raise PreflightError(ADAPTERS, f": {exc}") from None


def _check_memory(engine: EngineConfig, spec, adapters: EngineAdapters, draft,
                  available: Available) -> tuple[CachePlan, int]:
    """The engine's own cache rule (``memory.plan_cache``) on ``available``, the weights' size read from the
    safetensors headers, plus the adapter slots the engine would allocate and a draft model's weights and cache
    (on the AOT path, where it runs); and the bytes the loaded model then holds."""
    try:
        stock = stock_expected(spec, engine.kernels)
        kv_dtype = cache_dtype(engine.kv_cache_dtype, stock)
        model = Footprint.of(spec, adapters.bytes, stock=stock, kv_dtype=kv_dtype)
        if draft is not None and not stock:
            model = model.plus(Footprint.of(draft, kv_dtype=kv_dtype))
        plan = plan_cache(engine, model, available, spec.max_position_embeddings)
        return plan, model.weights_bytes + model.activation_bytes + plan.cache_bytes
    except MemoryBudgetError as exc:
        raise PreflightError(MEMORY, f": {exc}") from None
    except ValueError as exc:  # kvCacheDtype on a kernel path that does not store it (the message names the key)
        raise PreflightError(KV_CACHE, str(exc).removeprefix(KV_KEY)) from None


def _check_windows(engine: EngineConfig, max_position_embeddings: int | None) -> None:
    """The engine's own shape rules (``shapes.plan_shapes``) against the model."""
    try:
        plan_shapes(engine, max_position_embeddings)
    except ShapeError as exc:
        raise PreflightError(SCHEDULE, f".{exc}") from None
