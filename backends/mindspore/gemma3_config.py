"""Gemma 3 text's keys of a predict yaml's ``model.model_config`` (HF ``Gemma3TextConfig`` names) -> ``Gemma3Spec``;
what this tree does not implement (logit soft-capping, another activation or rope scaling type) is refused here,
naming the key."""
from __future__ import annotations

from backends.mindspore.spec import Gemma3Spec
from backends.mindspore.yaml_tree import ConfigError, YamlSection

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
