"""A model directory, read once: ``load_model(path) -> ModelSpec``, by the reader of the family that
``model.arch.type`` names (``families/``). A vision-language model's spec carries its ``vision`` part."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from backends.mindspore.families import BY_ARCH, family_of
from backends.mindspore.modeldir.llama_config import WEIGHT_DTYPES
from backends.mindspore.modeldir.spec import ModelSpec
from backends.mindspore.modeldir.yaml_tree import (DEVICE_TARGETS, ConfigError, deep_merge, find_model_yaml,
                                                   load_yaml_tree, read_json_object, read_model_yaml)

__all__ = ["DEVICE_TARGETS", "WEIGHT_DTYPES", "ConfigError", "ModelSpec", "deep_merge", "find_model_yaml",
           "load_model", "load_yaml_tree", "read_json_object", "torch_dtype"]


def load_model(path: Path | str) -> ModelSpec:
    """Read a model directory (or one yaml inside it) into a ``ModelSpec`` with its family's reader; for a
    vision-language arch, its language model's with ``vision`` set (``families/qwen2_vl/config.py``)."""
    yaml_path, tree, model, arch = read_model_yaml(path)
    family = family_of(arch)
    if family is None:
        raise ConfigError(yaml_path, "model.arch.type", f"{arch!r} is not supported; use one of {tuple(BY_ARCH)}")
    return family.read(yaml_path, tree, model, arch)


@functools.cache
def torch_dtype(model_dir: Path) -> str | None:
    """config.json's ``torch_dtype`` (what /info reports as the model dtype), None if absent."""
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None

