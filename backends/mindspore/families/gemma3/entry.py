"""Gemma 3 text (``Gemma3ForCausalLM``): the Llama-shaped fields plus its keys of a predict yaml's
``model.model_config`` (HF ``Gemma3TextConfig`` names) -> ``Gemma3Spec``; what this tree does not implement (logit
soft-capping, another activation or rope scaling type) is refused here, naming the key. Its networks are in
``network.py`` beside it; its GGUF (``gemma3``) stores the norms as 1 + w, names the pre-/post-norms its own way and
keeps the layer pattern implicit. Adapter slots (LoRA) are not implemented."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.mindspore.families.family import Capabilities, Family, GgufArch, HfWrapper, UnsupportedGguf
from backends.mindspore.modeldir.llama_config import LayerDefaults, llama_spec, model_config
from backends.mindspore.modeldir.spec import Gemma3Spec, ModelSpec
from backends.mindspore.modeldir.yaml_tree import ConfigError, YamlSection

LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma3_spec(mc: YamlSection, num_layers: int) -> Gemma3Spec:
    """``layer_types`` (or the older ``sliding_window_pattern``: every pattern-th layer global, default 6),
    ``sliding_window``, ``rope_local_base_freq``, ``rope_scaling`` (linear or none) and ``query_pre_attn_scalar``."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if mc.data.get(key) is not None:
            raise ConfigError(mc.path, f"{mc.prefix}.{key}",
                              f"logit soft-capping is not implemented; got {mc.data[key]!r} (Gemma 3 ships null)")
    if mc.get("use_bidirectional_attention", bool, False):
        raise ConfigError(mc.path, f"{mc.prefix}.use_bidirectional_attention",
                          "bidirectional attention (EmbeddingGemma) is not implemented: causal only")
    act = mc.get("hidden_act", str, "gelu_pytorch_tanh", "hidden_activation")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(mc.path, f"{mc.prefix}.hidden_act", f"only gelu_pytorch_tanh is implemented, got {act!r}")
    types = mc.get("layer_types", list, None)
    if types is None:
        pattern = mc.positive("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(mc.path, f"{mc.prefix}.layer_types",
                          f"must list {num_layers} entries of {LAYER_TYPES}, got {types!r}")
    return Gemma3Spec(
        sliding_window=mc.positive("sliding_window", 4096),
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        rope_local_theta=mc.get("rope_local_base_freq", float, 10000.0),
        rope_scaling_factor=_linear_factor(mc),
        attn_scale=float(mc.get("query_pre_attn_scalar", float, 256.0)) ** -0.5,
    )


def _linear_factor(mc: YamlSection) -> float:
    scaling = mc.get("rope_scaling", dict, None)
    if scaling is None:
        return 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return 1.0
    factor = scaling.get("factor")
    if kind != "linear" or isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ConfigError(mc.path, f"{mc.prefix}.rope_scaling",
                          f"only {{rope_type: linear, factor: > 0}} is implemented, got {scaling!r}")
    return float(factor)


def read(yaml_path: Path, tree: dict, model: YamlSection, arch: str) -> ModelSpec:
    """The Llama-shaped fields (Gemma's defaults: q/k norms, tied head), then ``gemma3``."""
    spec = llama_spec(yaml_path, tree, model, arch, DEFAULTS)
    return replace(spec, gemma3=gemma3_spec(model_config(yaml_path, model), spec.num_layers))


def gguf_config(meta: dict[str, Any], layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """The Gemma 3 keys of config.json from a ``gemma3`` GGUF, as llama.cpp's loader reads the file: every 6th layer
    global (``gemma3.attention.sliding_window_pattern`` when present), local rope base 10000
    (``gemma3.rope.freq_base_swa`` when present), a linear rope scaling factor on the global layers, and the score
    scale 1 / sqrt(head_dim) (GGUF keeps no query_pre_attn_scalar: llama.cpp uses head_dim, hidden / heads for the
    62-layer 27B, whose released query_pre_attn_scalar is that)."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if not isinstance(pattern, int) or pattern <= 0:
        raise UnsupportedGguf(f"gemma3.attention.sliding_window_pattern must be a positive int, got {pattern!r}")
    window = meta.get("gemma3.attention.sliding_window")
    if not window:
        raise UnsupportedGguf("gemma3 GGUF without gemma3.attention.sliding_window (a sliding-window size)")
    scaling = meta.get("gemma3.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise UnsupportedGguf(f"gemma3.rope.scaling.type {scaling!r}: only linear is implemented")
    factor = meta.get("gemma3.rope.scaling.factor") if scaling == "linear" else None
    return {
        "sliding_window": int(window),
        "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)],
        "rope_local_base_freq": float(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
        "rope_scaling": {"rope_type": "linear", "factor": float(factor)} if factor else None,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }


DEFAULTS = LayerDefaults(qk_norm=True, tied=True)

GEMMA3 = Family(
    name="gemma3", described="Gemma 3", archs=("Gemma3ForCausalLM",), read=read, defaults=DEFAULTS,
    aot="backends.mindspore.families.gemma3.network:AotGemma3",
    stock="backends.mindspore.families.gemma3.network:StockGemma3",
    capabilities=Capabilities(lora=False, sliding_window=True),
    gguf=GgufArch("gemma3", "Gemma3ForCausalLM", "gemma3_text", permuted_qk=False,
                  renames=(("ffn_norm", "pre_feedforward_layernorm"),
                           ("post_attention_norm", "post_attention_layernorm"),
                           ("post_ffw_norm", "post_feedforward_layernorm")), norm_shift=1.0, config=gguf_config),
    config_keys=("sliding_window", "sliding_window_pattern", "layer_types", "rope_local_base_freq",
                 "query_pre_attn_scalar", "hidden_act", "hidden_activation", "final_logit_softcapping",
                 "attn_logit_softcapping", "rope_scaling"),
    hf_wrapper=HfWrapper("gemma3", "Gemma3ForConditionalGeneration",
                         "(Gemma 3 with vision) is not served; the text model Gemma3ForCausalLM is"),
)
