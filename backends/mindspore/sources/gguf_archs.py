"""The GGUF architectures ``convert-gguf`` imports (``general.architecture``): each family's ``GgufArch``
(``families/``) says what it means for the HF layout written: the HF architecture and ``model_type``, and whether
llama.cpp's converter permuted the Q/K rows (interleaved RoPE: only ``llama``; the others run llama.cpp's NEOX RoPE,
which is HF's rotate_half, so their rows are as HF has them), renamed tensors, shifted norms and the family's own
config keys. Biases (``attn_q.bias``, Qwen2) and q/k head norms (``attn_q_norm``) are read from the tensors the file
has; routed experts (``ffn_gate_inp`` and the 3-D ``ffn_*_exps``) from the ``<arch>.expert_*`` metadata and the
tensors."""
from __future__ import annotations

from typing import Any

from backends.mindspore.families import FAMILIES, GgufArch, UnsupportedGguf

__all__ = ["GGUF_ARCHS", "GgufArch", "UnsupportedGguf", "arch_of_model_type", "gguf_arch", "head_dim"]

GGUF_ARCHS = {f.gguf.name: f.gguf for f in FAMILIES if f.gguf is not None}


def arch_of_model_type(model_type: str) -> GgufArch:
    return next(a for a in GGUF_ARCHS.values() if a.model_type == model_type)


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
