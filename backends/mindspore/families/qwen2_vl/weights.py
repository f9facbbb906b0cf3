"""Qwen2-VL weights from the HF safetensors layout: the released names (``model.layers.*``, ``visual.*``,
``lm_head``; a transformers >= 4.52 save renamed back), every parameter the towers read checked by name
and shape against the config before a cell is built."""
from __future__ import annotations

import numpy as np

from backends.mindspore.modeldir.yaml_tree import ConfigError
from backends.mindspore.families.qwen2_vl.config import VLSpec
from backends.mindspore.modeldir.weights import WeightsError, load_weights


def split_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Released names as they are; a checkpoint saved by transformers >= 4.52 (``model.language_model.*``,
    ``model.visual.*``) renamed back to them."""
    out = {}
    for name, value in weights.items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        elif name.startswith("model.visual."):
            name = name[len("model."):]
        out[name] = value
    return out


def expected_shapes(spec: VLSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter the two towers read, with its HF shape ([out, in] for linears)."""
    t, v = spec.text, spec.vision
    d, hd = t.hidden_size, t.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (t.vocab_size, d), "model.norm.weight": (d,)}
    if not t.tie_word_embeddings:
        shapes["lm_head.weight"] = (t.vocab_size, d)
    for i in range(t.num_layers):
        p = f"model.layers.{i}."
        for n, out in (("q", t.num_heads * hd), ("k", t.num_kv_heads * hd), ("v", t.num_kv_heads * hd)):
            shapes[p + f"self_attn.{n}_proj.weight"] = (out, d)
            if t.qkv_has_bias:
                shapes[p + f"self_attn.{n}_proj.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (d, t.num_heads * hd)
        shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (t.intermediate_size, d)
        shapes[p + "mlp.down_proj.weight"] = (d, t.intermediate_size)
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (d,)
    w, layer_norm = v.width, v.family == "qwen2_vl"
    shapes["visual.patch_embed.proj.weight"] = (w, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    linears = {"attn.qkv": (3 * w, w), "attn.proj": (w, w)}
    if layer_norm:
        linears.update({"mlp.fc1": (v.mlp_hidden, w), "mlp.fc2": (w, v.mlp_hidden)})
    else:
        linears.update({"mlp.gate_proj": (v.mlp_hidden, w), "mlp.up_proj": (v.mlp_hidden, w),
                        "mlp.down_proj": (w, v.mlp_hidden)})
    norms = ["norm1", "norm2"]
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        for name, shape in linears.items():
            shapes[p + name + ".weight"], shapes[p + name + ".bias"] = shape, (shape[0],)
        for norm in norms:
            shapes[p + norm + ".weight"] = (w,)
            if layer_norm:
                shapes[p + norm + ".bias"] = (w,)
    merged = w * v.merge_size ** 2
    shapes["visual.merger.ln_q.weight"] = (w,)
    if layer_norm:
        shapes["visual.merger.ln_q.bias"] = (w,)
    shapes.update({"visual.merger.mlp.0.weight": (merged, merged), "visual.merger.mlp.0.bias": (merged,),
                   "visual.merger.mlp.2.weight": (v.out_dim, merged), "visual.merger.mlp.2.bias": (v.out_dim,)})
    return shapes


def load_vl_weights(spec: VLSpec) -> dict[str, np.ndarray]:
    """The checkpoint's arrays, checked name by name and shape by shape against the config."""
    if spec.text.checkpoint_format != "safetensors":
        raise ConfigError(spec.text.yaml_path, "load_ckpt_format",
                          f"a vision-language model loads from the HF safetensors layout, got "
                          f"{spec.text.checkpoint_format!r}")
    weights = split_weights(load_weights(spec.text.checkpoint, "safetensors"))
    if spec.text.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    shapes = expected_shapes(spec)
    missing = sorted(set(shapes) - set(weights))
    unknown = sorted(set(weights) - set(shapes))
    if missing or unknown:
        raise WeightsError(f"{spec.text.checkpoint}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                           f"unexpected {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
    for name, shape in shapes.items():
        if weights[name].shape != shape:
            raise WeightsError(f"{spec.text.checkpoint}: {name} has shape {list(weights[name].shape)}, "
                               f"the config asks for {list(shape)}")
    return weights
