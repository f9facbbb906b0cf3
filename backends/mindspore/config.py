"""A model directory, read once: ``load_model(path) -> ModelSpec``, dispatching on ``model.arch.type``
through the one architecture table (``spec.ARCHITECTURES``). A vision-language model's spec carries its
``vision`` part; "is this a vision model?" is ``spec.vision is not None`` everywhere."""
from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

from backends.mindspore.llama_config import WEIGHT_DTYPES, llama_spec
from backends.mindspore.qwen2_vl.config import vl_spec
from backends.mindspore.spec import ARCHITECTURES, VISION_FAMILIES, ModelSpec
from backends.mindspore.yaml_tree import (DEVICE_TARGETS, ConfigError, deep_merge, find_model_yaml, load_yaml_tree,
                                          read_json_object, read_model_yaml)

__all__ = ["DEVICE_TARGETS", "WEIGHT_DTYPES", "ConfigError", "ModelSpec", "deep_merge", "find_model_yaml",
           "load_model", "load_model_spec", "load_yaml_tree", "read_json_object", "torch_dtype"]


def load_model(path: Path | str) -> ModelSpec:
    """Read a model directory (or one yaml inside it) into a ``ModelSpec``; for a vision-language arch, its
    language model's with ``vision`` set (``qwen2_vl/config.py``)."""
    yaml_path, tree, model, arch = read_model_yaml(path)
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise ConfigError(yaml_path, "model.arch.type", f"{arch!r} is not supported; use one of {tuple(ARCHITECTURES)}")
    if family in VISION_FAMILIES:
        vl = vl_spec(yaml_path, tree, model, arch)
        return replace(vl.text, vision=vl)
    return llama_spec(yaml_path, tree, model, arch)


load_model_spec = load_model  # the name bench/ still calls


@functools.cache
def torch_dtype(model_dir: Path) -> str | None:
    """config.json's ``torch_dtype`` (what /info reports as the model dtype), None if absent."""
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None

