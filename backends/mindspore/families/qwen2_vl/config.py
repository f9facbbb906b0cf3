"""A Qwen2-VL / Qwen2.5-VL predict yaml (MindFormers style, ``base_config`` inheritance) -> frozen ``VLSpec``.

The yaml's ``model.model_config`` is the language model (the LlamaConfig keys of the text yamls, plus
``mrope_section`` and the vision token ids), ``model.vision_config`` the vision tower (HF's
``vision_config`` keys), ``processor.image_processor`` / ``processor.video`` the preprocessing. A key
the yaml leaves out is read from the model directory's config.json / preprocessor_config.json (HF's
names), so a released checkpoint needs only the yaml's arch and checkpoint lines. Errors name the file
and the dotted key.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.mindspore.modeldir.spec import ModelSpec, ProcessorSpec, VisionSpec, VLSpec
from backends.mindspore.modeldir.yaml_tree import (ConfigError, YamlSection, read_checkpoint, read_context,
                                                   read_defaults, read_eos_ids, read_json_object, read_model_yaml)

__all__ = ["ProcessorSpec", "VisionSpec", "VLSpec", "activation_bytes", "load_vl_spec", "processor_chat_template",
           "vision_buckets", "vl_spec"]
_ACTS = ("quick_gelu", "silu", "gelu")
# model.arch.type -> the vision tower's layout (VisionSpec.family)
TOWERS = {"Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}


class _Merged(YamlSection):
    """The yaml's section, falling back to a config.json mapping for the keys it leaves out."""

    def __init__(self, path: Path, prefix: str, data: Any, fallback: dict) -> None:
        super().__init__(path, prefix, data)
        self.data = {**fallback, **{k: v for k, v in self.data.items() if v is not None}}


def load_vl_spec(path: Path | str) -> VLSpec:
    """Read a vision-language model directory (or one yaml inside it) into a ``VLSpec`` (``families.load_model``
    reads any model directory)."""
    return vl_spec(*read_model_yaml(path))


def vl_spec(yaml_path: Path, tree: dict, model: YamlSection, arch: str) -> VLSpec:
    """The ``VLSpec`` of a vision-language yaml tree (``yaml_tree.read_model_yaml``)."""
    family = TOWERS.get(arch)
    if family is None:
        raise ConfigError(yaml_path, "model.arch.type", f"{arch!r} is not a vision-language arch; use one of "
                                                        f"{tuple(TOWERS)}")
    hf = read_json_object(yaml_path.parent / "config.json")
    hf_text = {**hf, **(hf.get("text_config") or {})}
    mc = _Merged(yaml_path, "model.model_config", model.get("model_config", dict, {}), _text_fallback(hf_text))
    text = _text_spec(yaml_path, tree, mc, arch)
    section = mc.get("mrope_section", list, None) or (hf_text.get("rope_scaling") or {}).get("mrope_section")
    if (not isinstance(section, list) or len(section) != 3 or not all(isinstance(s, int) and s > 0 for s in section)
            or 2 * sum(section) != text.head_dim):
        raise ConfigError(yaml_path, "model.model_config.mrope_section",
                          f"must be 3 positive ints summing to head_dim/2 = {text.head_dim // 2}, got {section!r}")
    vc = _Merged(yaml_path, "model.vision_config", model.get("vision_config", dict, {}), hf.get("vision_config") or {})
    vision = _vision_spec(yaml_path, vc, family, text.hidden_size)
    proc = YamlSection(yaml_path, "processor", tree.get("processor") or {})
    pre = read_json_object(yaml_path.parent / "preprocessor_config.json")
    vl = VLSpec(
        family=family, text=text, vision=vision,
        processor=_processor_spec(yaml_path, proc, pre, vision),
        mrope_section=tuple(section),
        image_token_id=mc.get("image_token_id", int), video_token_id=mc.get("video_token_id", int),
        vision_start_token_id=mc.get("vision_start_token_id", int),
    )
    return replace(vl, tower_bytes=activation_bytes(vl))


def _text_fallback(hf: dict) -> dict:
    """config.json's text keys under the yaml's LlamaConfig names."""
    names = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
             "num_key_value_heads": "n_kv_heads", "rope_theta": "theta",
             "max_position_embeddings": "max_position_embedding"}
    out = {names.get(k, k): v for k, v in hf.items() if not isinstance(v, dict)}
    if "max_position_embeddings" in hf:
        out.setdefault("seq_length", hf["max_position_embeddings"])
    return out


def _text_spec(yaml_path: Path, tree: dict, mc: YamlSection, arch: str) -> ModelSpec:
    hidden, heads = mc.positive("hidden_size"), mc.positive("num_heads")
    kv_heads = mc.positive("n_kv_heads", heads)
    if hidden % heads or heads % kv_heads:
        raise ConfigError(yaml_path, "model.model_config.num_heads",
                          f"num_heads {heads} must divide hidden_size {hidden} and be a multiple of n_kv_heads "
                          f"{kv_heads}")
    seq_length = mc.positive("seq_length", 4096)
    ckpt, fmt = read_checkpoint(tree, yaml_path)
    mode, target = read_context(tree, yaml_path)
    tok = YamlSection(yaml_path, "processor", tree.get("processor") or {}).get("tokenizer", dict, {})
    return ModelSpec(
        yaml_path=yaml_path, model_dir=yaml_path.parent, arch=arch,
        hidden_size=hidden, num_layers=mc.positive("num_layers"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hidden // heads, intermediate_size=mc.positive("intermediate_size"),
        vocab_size=mc.positive("vocab_size"), rms_norm_eps=mc.get("rms_norm_eps", float, 1e-6),
        rope_theta=mc.get("theta", float, 1000000.0),
        max_position_embeddings=mc.positive("max_position_embedding", seq_length), seq_length=seq_length,
        qkv_has_bias=mc.get("qkv_has_bias", bool, True),
        tie_word_embeddings=mc.get("tie_word_embeddings", bool, False),
        bos_token_id=mc.get("bos_token_id", int, None),
        eos_token_ids=read_eos_ids(mc.get("eos_token_id", (int, list), 151645), yaml_path),
        pad_token_id=mc.get("pad_token_id", int, None),
        compute_dtype=mc.get("compute_dtype", str, "float32"), checkpoint=ckpt, checkpoint_format=fmt,
        tokenizer=tok, mode=mode, device_target=target, defaults=read_defaults(mc),
        config_vocab_size=mc.positive("vocab_size"),
    )


def _vision_spec(yaml_path: Path, vc: YamlSection, family: str, text_hidden: int) -> VisionSpec:
    qwen2 = family == "qwen2_vl"
    width = vc.positive("embed_dim") if qwen2 else vc.positive("hidden_size")
    heads = vc.positive("num_heads")
    if width % heads or (width // heads) % 4:
        raise ConfigError(yaml_path, "model.vision_config.num_heads",
                          f"{heads} heads over width {width}: head_dim must be a multiple of 4 (2-D rotary)")
    act = vc.get("hidden_act", str, "quick_gelu" if qwen2 else "silu")
    if act not in _ACTS:
        raise ConfigError(yaml_path, "model.vision_config.hidden_act", f"must be one of {_ACTS}, got {act!r}")
    mlp_hidden = int(width * vc.get("mlp_ratio", (int, float), 4)) if qwen2 else vc.positive("intermediate_size")
    out_dim = vc.positive("hidden_size") if qwen2 else vc.positive("out_hidden_size")
    if out_dim != text_hidden:
        raise ConfigError(yaml_path, "model.vision_config." + ("hidden_size" if qwen2 else "out_hidden_size"),
                          f"{out_dim} must equal the language model's hidden_size {text_hidden}")
    depth = vc.positive("depth")
    full = tuple(vc.get("fullatt_block_indexes", list, [])) if not qwen2 else ()
    if any(not isinstance(i, int) or not 0 <= i < depth for i in full):
        raise ConfigError(yaml_path, "model.vision_config.fullatt_block_indexes",
                          f"must be block indexes in [0, {depth}), got {list(full)}")
    spec = VisionSpec(
        family=family, depth=depth, width=width, num_heads=heads, mlp_hidden=mlp_hidden, hidden_act=act,
        out_dim=out_dim, patch_size=vc.positive("patch_size", 14), temporal_patch_size=vc.positive(
            "temporal_patch_size", 2), merge_size=vc.positive("spatial_merge_size", 2),
        in_channels=vc.positive("in_channels", 3, "in_chans"),
        window_size=0 if qwen2 else vc.positive("window_size", 112), full_attention_blocks=full,
        tokens_per_second=float(vc.get("tokens_per_second", (int, float), 2)),
    )
    if spec.window_size and spec.window_units < 1:
        raise ConfigError(yaml_path, "model.vision_config.window_size",
                          f"{spec.window_size} px is smaller than one merged unit "
                          f"({spec.patch_size * spec.merge_size} px)")
    return spec


def _processor_spec(yaml_path: Path, proc: YamlSection, pre: dict, vision: VisionSpec) -> ProcessorSpec:
    size = pre.get("size") or {}
    fallback = {"min_pixels": size.get("shortest_edge", size.get("min_pixels")),
                "max_pixels": size.get("longest_edge", size.get("max_pixels")), **pre}
    ip = _Merged(yaml_path, "processor.image_processor", proc.get("image_processor", dict, {}), fallback)
    video = YamlSection(yaml_path, "processor.video", proc.get("video", dict, {}))
    mean, std = ip.get("image_mean", list, [0.48145466, 0.4578275, 0.40821073]), ip.get(
        "image_std", list, [0.26862954, 0.26130258, 0.27577711])
    for key, value in (("image_mean", mean), ("image_std", std)):
        if len(value) != 3 or not all(isinstance(v, (int, float)) for v in value) or (
                key == "image_std" and min(value) <= 0):
            raise ConfigError(yaml_path, f"processor.image_processor.{key}", f"must be 3 numbers, got {value!r}")
    spec = ProcessorSpec(
        min_pixels=ip.positive("min_pixels", 56 * 56), max_pixels=ip.positive("max_pixels", 28 * 28 * 1280),
        image_mean=tuple(float(v) for v in mean), image_std=tuple(float(v) for v in std),
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size, merge_size=vision.merge_size,
        video_fps=video.get("fps", float, 2.0), video_min_frames=video.positive("min_frames", 4),
        video_max_frames=video.positive("max_frames", 768), video_frames=video.positive("frames", None),
    )
    if spec.min_pixels > spec.max_pixels:
        raise ConfigError(yaml_path, "processor.image_processor.min_pixels",
                          f"{spec.min_pixels} exceeds max_pixels {spec.max_pixels}")
    if spec.video_fps <= 0:
        raise ConfigError(yaml_path, "processor.video.fps", f"must be > 0, got {spec.video_fps}")
    return spec


VISION_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # patches per vision-tower call


def vision_buckets(spec: VLSpec) -> tuple[int, ...]:
    """The patch buckets the engine compiles: the powers of two of ``VISION_BUCKETS`` below the largest image
    (``max_pixels``), then that image's own patch count (rounded up to whole merge groups), so the largest
    call pads nothing (Qwen2-VL 7B's 1003520 pixels: 5120 patches, not 8192)."""
    merge2 = spec.vision.merge_size ** 2
    largest = -(-(spec.processor.max_pixels // spec.processor.patch_size ** 2) // merge2) * merge2
    return (*(b for b in VISION_BUCKETS if b < largest and b % merge2 == 0), largest)


def activation_bytes(spec: VLSpec) -> int:
    """float32 bytes the tower's largest call holds at once (an estimate for the memory budget): the full
    attention's scores per head over the largest bucket, the window layout's scores, and a few [N, width]
    and [N, mlp] buffers."""
    v = spec.vision
    n = vision_buckets(spec)[-1]
    full = v.num_heads * n * n
    windows = v.num_heads * (n // v.merge_size ** 2) * (v.window_units * v.merge_size) ** 4 if v.window_size else 0
    rows = n * (8 * v.width + 2 * v.mlp_hidden + v.patch_dim)
    return 4 * (2 * max(full, windows) + rows)


def processor_chat_template(model_dir: Path) -> str:
    """The released checkpoints' chat_template.json (the processor's template), when the tokenizer has none."""
    path = model_dir / "chat_template.json"
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if not isinstance(template, str):
        raise ConfigError(path, "chat_template", "no chat template in tokenizer_config.json or chat_template.json")
    return template
