"""Qwen2-VL and Qwen2.5-VL: a vision tower and M-RoPE over a Qwen2 language model (``qwen2_vl/``: the reader, the
tower, the text network). Its layers take no adapter slots, and its stock-op path runs float32."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from backends.mindspore.families.family import Capabilities, Family
from backends.mindspore.qwen2_vl.config import TOWERS, vl_spec
from backends.mindspore.spec import ModelSpec
from backends.mindspore.yaml_tree import YamlSection


def read(yaml_path: Path, tree: dict, model: YamlSection, arch: str) -> ModelSpec:
    """The language model's spec with ``vision`` set (its ``VLSpec``)."""
    vl = vl_spec(yaml_path, tree, model, arch)
    return replace(vl.text, vision=vl)


QWEN2_VL = Family(
    name="qwen2_vl", described="a vision-language model", archs=tuple(TOWERS), read=read,
    aot="backends.mindspore.qwen2_vl.text:AotQwen2VLText", stock="backends.mindspore.qwen2_vl.text:StockQwen2VLText",
    capabilities=Capabilities(lora=False, vision=True, stock_low_precision=False),
)
