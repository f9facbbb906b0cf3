"""The GGUF architectures ``convert-gguf`` imports (``general.architecture``), and what each one means for the HF
layout it writes: the HF architecture and ``model_type``, and whether llama.cpp's converter permuted the Q/K rows
(interleaved RoPE: only ``llama``; ``qwen2`` / ``qwen3`` run llama.cpp's NEOX RoPE, which is HF's rotate_half, so
their rows are as HF has them). Biases (``attn_q.bias``, Qwen2) and q/k head norms (``attn_q_norm``, Qwen3) are
read from the tensors the file has; routed experts (``qwen3moe``: ``ffn_gate_inp`` and the 3-D ``ffn_*_exps``) from
the ``<arch>.expert_*`` metadata and the tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GgufArch:
    name: str  # general.architecture, the prefix of its metadata keys (``qwen3.embedding_length``)
    hf_arch: str  # config.json architectures[0], the predict yaml's model.arch.type
    model_type: str
    permuted_qk: bool  # llama.cpp permuted the Q/K rows for interleaved RoPE (undone at conversion)


GGUF_ARCHS = {a.name: a for a in (
    GgufArch("llama", "LlamaForCausalLM", "llama", permuted_qk=True),
    GgufArch("qwen2", "Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    GgufArch("qwen3", "Qwen3ForCausalLM", "qwen3", permuted_qk=False),
    GgufArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", permuted_qk=False),
)}


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
