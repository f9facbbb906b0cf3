"""One served model's directory from its config entry (``prepare_model``): a model directory as it is, the default
model prepared on first use, and a GGUF, an HF directory or a package (``pypi:NAME``) through the model cache; and
the MODEL arguments of ``serve`` as ModelConfig entries. Reaches the backend only through ``backends.loader``."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from backends.loader import (ModelSourceError, ModelStore, default_model_dtype, is_default_model, is_model_dir,
                             prepare_default_model, resolve_source)

log = logging.getLogger("mindserve")


class ModelEntry(Protocol):
    """What ``prepare_model`` reads of a ModelConfig entry (``service.config.ModelSettings``)."""

    name: str
    weight_path: Path


def prepare_model(model: ModelEntry, *, models_dir: Path, dtype: str | None = None,
                  progress: bool = True) -> Path:
    """The model directory for one ModelConfig entry, converted into ``models_dir`` first if need be (``dtype``:
    a GGUF's convert-gguf --dtype, default as-shipped). ValueError naming the entry's model and source."""
    path = model.weight_path
    if is_model_dir(path):
        return path
    if is_default_model(path):
        log.info("default model not found at %s: preparing it (download + conversion --dtype %s)", path,
                 default_model_dtype(path))
        return prepare_default_model(path)
    try:
        source = resolve_source(path)
    except ModelSourceError as exc:
        raise ModelSourceError(f"model {model.name}: {exc}") from None
    return ModelStore(models_dir).prepare(source, dtype, progress=progress)


def model_entries(references: list[str], *, models_dir: Path, dtype: str | None = None) -> list[dict[str, Any]]:
    """The ModelConfig entries of ``serve MODEL ...``: each named after its source, its modelWeightPath the cached
    model directory when the cache holds it already (looked up without hashing), else the source itself (serve
    converts it after binding its ports). ModelSourceError naming a reference that names nothing."""
    store = ModelStore(models_dir)
    store.clean_stale()
    entries = []
    for reference in references:
        source = resolve_source(reference)
        cached = store.lookup(source, dtype)
        if cached is not None:
            log.info("model %s: from the model cache, %s", source.name, cached)
        entries.append({"modelName": source.name, "modelWeightPath": str(cached or source.reference())})
    return entries
