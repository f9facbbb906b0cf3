"""The model families, one registry entry each (``family.py``: what an entry declares), and the lookups every
reader of a model directory, GGUF file or HF directory asks. A family is chosen once, when the model directory is
read (``load_model``), by its architecture name; adding one is its module here, one line in ``FAMILIES`` and its
tests (docs/architecture.md, "Adding a model family")."""
from __future__ import annotations

from pathlib import Path

from backends.mindspore.families.family import (Capabilities, Family, GgufArch, HfWrapper, MediaPrompt, UnsupportedGguf,
                                               VisionPart, table)
from backends.mindspore.families.gemma3.entry import GEMMA3
from backends.mindspore.families.llama import LLAMA
from backends.mindspore.families.qwen2 import QWEN2
from backends.mindspore.families.qwen2_vl.entry import QWEN2_VL
from backends.mindspore.families.qwen3 import QWEN3
from backends.mindspore.families.qwen3_moe.entry import QWEN3_MOE
from backends.mindspore.modeldir.spec import ModelSpec
from backends.mindspore.modeldir.yaml_tree import ConfigError, read_model_yaml

__all__ = ["FAMILIES", "Capabilities", "Family", "GgufArch", "HfWrapper", "MediaPrompt", "UnsupportedGguf",
           "VisionPart", "family_of", "load_model", "refuse_adapters"]

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, GEMMA3, QWEN2_VL)
BY_ARCH = table(FAMILIES)


def family_of(arch: str) -> Family | None:
    """The family of an HF architecture name (model.arch.type), None if no family reads it."""
    return BY_ARCH.get(arch)


def load_model(path: Path | str) -> ModelSpec:
    """Read a model directory (or one yaml inside it) into a ``ModelSpec`` with its family's reader (a
    vision-language model's spec carries its ``vision`` part)."""
    yaml_path, tree, model, arch = read_model_yaml(path)
    family = family_of(arch)
    if family is None:
        raise ConfigError(yaml_path, "model.arch.type", f"{arch!r} is not supported; use one of {tuple(BY_ARCH)}")
    return family.read(yaml_path, tree, model, arch)


def refuse_adapters(arch: str, enabled: bool) -> None:
    """The one rule on adapters: a family whose layers take no adapter slots is served without LoRA. Asked before
    anything else is read (preflight, and the engine's first part); ValueError naming the settings to remove."""
    family = BY_ARCH[arch]
    if enabled and not family.capabilities.lora:
        raise ValueError(f"LoRA adapters are not supported for {family.described} ({arch}); remove LoraModules and "
                         "allowRuntimeLoraUpdating")
