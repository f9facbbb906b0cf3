"""Qwen2-VL and Qwen2.5-VL: a vision tower and M-RoPE over a Qwen2 language model (this folder: the reader, the
tower, the text network). Its layers take no adapter slots, and its stock-op path runs float32."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from backends.mindspore.families.family import Capabilities, Family
from backends.mindspore.families.qwen2_vl.config import TOWERS, vl_spec
from backends.mindspore.modeldir.spec import ModelSpec
from backends.mindspore.modeldir.yaml_tree import YamlSection


def read(yaml_path: Path, tree: dict, model: YamlSection, arch: str) -> ModelSpec:
    """The language model's spec with ``vision`` set (its ``VLSpec``)."""
    vl = vl_spec(yaml_path, tree, model, arch)
    return replace(vl.text, vision=vl)


QWEN2_VL = Family(
    name="qwen2_vl", described="a vision-language model", archs=tuple(TOWERS), read=read,
    aot="backends.mindspore.families.qwen2_vl.text:AotQwen2VLText",
    stock="backends.mindspore.families.qwen2_vl.text:StockQwen2VLText",
    capabilities=Capabilities(lora=False, vision=True, stock_low_precision=False),
    vision="backends.mindspore.families.qwen2_vl.encoder:VisionEncoder",
)
