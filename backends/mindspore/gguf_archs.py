"""The GGUF architectures ``convert-gguf`` imports (``general.architecture``), and what each one means for the HF
layout it writes: the HF architecture and ``model_type``, and whether llama.cpp's converter permuted the Q/K rows
(interleaved RoPE: only ``llama``; ``qwen2`` / ``qwen3`` / ``gemma3`` run llama.cpp's NEOX RoPE, which is HF's
rotate_half, so their rows are as HF has them). ``gemma3`` also stored its norms as 1 + w, names Gemma's pre-/post-
norms its own way and keeps its layer pattern implicit (``gemma3_config``). Biases (``attn_q.bias``, Qwen2) and q/k
head norms (``attn_q_norm``, Qwen3, Gemma 3) are read from the tensors the file has; routed experts (``qwen3moe``:
``ffn_gate_inp`` and the 3-D ``ffn_*_exps``) from the ``<arch>.expert_*`` metadata and the tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GgufArch:
    name: str  # general.architecture, the prefix of its metadata keys (``qwen3.embedding_length``)
    hf_arch: str  # config.json architectures[0], the predict yaml's model.arch.type
    model_type: str
    permuted_qk: bool  # llama.cpp permuted the Q/K rows for interleaved RoPE (undone at conversion)
    renames: tuple[tuple[str, str], ...] = ()  # GGUF layer tensor kinds whose HF names differ from the Llama ones
    norm_shift: float = 0.0  # llama.cpp stored every ``*norm.weight`` plus this (Gemma 3: 1 + w); undone at import


GGUF_ARCHS = {a.name: a for a in (
    GgufArch("llama", "LlamaForCausalLM", "llama", permuted_qk=True),
    GgufArch("qwen2", "Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    GgufArch("qwen3", "Qwen3ForCausalLM", "qwen3", permuted_qk=False),
    GgufArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", permuted_qk=False),
    GgufArch("gemma3", "Gemma3ForCausalLM", "gemma3_text", permuted_qk=False,
             renames=(("ffn_norm", "pre_feedforward_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                      ("post_ffw_norm", "post_feedforward_layernorm")), norm_shift=1.0),
)}


def arch_of_model_type(model_type: str) -> GgufArch:
    return next(a for a in GGUF_ARCHS.values() if a.model_type == model_type)


def gemma3_config(meta: dict[str, Any], layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
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
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }


class UnsupportedGguf(ValueError):
    """A GGUF this converter cannot import (its message names what and the supported choices)."""


def gguf_arch(meta: dict[str, Any]) -> GgufArch:
    """The ``GgufArch`` of a GGUF's metadata; ``UnsupportedGguf`` naming the architecture and the supported ones."""
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHS:
        raise UnsupportedGguf(f"unsupported GGUF general.architecture {name!r}: convert-gguf imports "
                              f"{', '.join(repr(a) for a in GGUF_ARCHS)}")
    return GGUF_ARCHS[name]


def head_dim(meta: dict[str, Any], arch: GgufArch, hidden: int, heads: int) -> int:
    """``<arch>.attention.key_length`` (Qwen3's head_dim, not hidden / heads), else the RoPE dimension count, else
    hidden / heads."""
    for key in ("attention.key_length", "rope.dimension_count"):
        value = meta.get(f"{arch.name}.{key}")
        if value is not None:
            return int(value)
    return hidden // heads
