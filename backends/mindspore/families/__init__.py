"""The model families, one registry entry each (``family.py``: what an entry declares), and the lookups every
reader of a model directory, GGUF file or HF directory asks. A family is chosen once, when the model directory is
read (``config.load_model``), by its architecture name; adding one is its module here, one line in ``FAMILIES``
and its tests (docs/architecture.md, "Adding a family")."""
from __future__ import annotations

from backends.mindspore.families.family import Capabilities, Family, GgufArch, HfWrapper, UnsupportedGguf, table
from backends.mindspore.families.gemma3.entry import GEMMA3
from backends.mindspore.families.llama import LLAMA
from backends.mindspore.families.qwen2 import QWEN2
from backends.mindspore.families.qwen2_vl.entry import QWEN2_VL
from backends.mindspore.families.qwen3 import QWEN3
from backends.mindspore.families.qwen3_moe.entry import QWEN3_MOE

__all__ = ["FAMILIES", "Capabilities", "Family", "GgufArch", "HfWrapper", "UnsupportedGguf", "family_of",
           "refuse_adapters"]

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, GEMMA3, QWEN2_VL)
BY_ARCH = table(FAMILIES)


def family_of(arch: str) -> Family | None:
    """The family of an HF architecture name (model.arch.type), None if no family reads it."""
    return BY_ARCH.get(arch)


def refuse_adapters(arch: str, enabled: bool) -> None:
    """The one rule on adapters: a family whose layers take no adapter slots is served without LoRA. Asked before
    anything else is read (preflight, and the engine's first part); ValueError naming the settings to remove."""
    family = BY_ARCH[arch]
    if enabled and not family.capabilities.lora:
        raise ValueError(f"LoRA adapters are not supported for {family.described} ({arch}); remove LoraModules and "
                         "allowRuntimeLoraUpdating")
