"""A tiny HF-layout model directory (tests/support/tiny_model.py, make_tiny_qwen3.py, make_tiny_qwen3_moe.py,
make_tiny_gemma3.py) written as a float32 GGUF of the ``llama``, ``qwen2``, ``qwen3``, ``qwen3moe`` or ``gemma3``
architecture (the experts' per-expert matrices stacked into llama.cpp's 3-D ``ffn_{gate,up,down}_exps`` [E, out, in],
the router as ``ffn_gate_inp``), the way llama.cpp's convert_hf_to_gguf.py lays it out, written out independently of
the converter under test: ``<arch>.*`` metadata, ``blk.N.*`` tensor names, the Q/K rows permuted for ``llama`` only
(interleaved RoPE; qwen2/qwen3/gemma3 use NEOX RoPE, HF's own rows), gemma3's norms stored as 1 + w with its window
and rope scaling in the metadata, the byte-level BPE vocabulary as ``tokenizer.ggml.*`` with the ``smollm``
pre-tokenizer (digits split, then byte-level: what ``tiny_model.train_tokenizer`` builds)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.support.gguf_rows import hf_to_gguf_rows

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
# Gemma 3's four norms a layer (llama.cpp: attn_norm, post_attention_norm, ffn_norm = the pre-feedforward norm,
# post_ffw_norm)
_GEMMA3_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _gemma3_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """As convert_hf_to_gguf.py's Gemma3Model: the window, the global layers' linear scaling."""
    w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("rope_scaling"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg["rope_scaling"]["factor"])


@dataclass(frozen=True)
class _Layout:
    """What convert_hf_to_gguf.py's model class for one GGUF architecture does its own way (this writer's own table,
    kept apart from the registry's GgufArch: it is the converter's independent counterpart)."""

    layer_names: dict[str, str] = field(default_factory=lambda: _LAYER)  # HF module -> GGUF tensor kind
    permuted_qk: bool = False  # interleaved RoPE: the Q/K rows permuted, the rope dimension count written
    norm_shift: float = 0.0  # every ``*norm.weight`` stored as shift + w (Gemma3RMSNorm's 1 + w)
    metadata: Callable[[gguf.GGUFWriter, dict], None] | None = None  # its own keys from config.json


_LAYOUTS = {"llama": _Layout(permuted_qk=True), "qwen2": _Layout(), "qwen3": _Layout(), "qwen3moe": _Layout(),
            "gemma3": _Layout(_GEMMA3_LAYER, norm_shift=1.0, metadata=_gemma3_metadata)}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYOUTS[arch].layer_names[module]}.{kind}"


def write_gguf(model_dir: Path, path: Path, arch: str, spm: dict | None = None) -> Path:
    """Write ``model_dir`` (config.json, model.safetensors, tokenizer.json) as a float32 GGUF of ``arch``; with
    ``spm`` (``tokenizer.ggml.*`` metadata of a SentencePiece vocabulary, tests/golden/spm_tiny.json) that vocabulary
    instead of the directory's tokenizer (the embedding must have as many rows)."""
    cfg, layout = json.loads((model_dir / "config.json").read_text()), _LAYOUTS[arch]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(model_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    if layout.permuted_qk:
        w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(cfg["rope_theta"])
    if layout.metadata:
        layout.metadata(w, cfg)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if spm is None:
        _add_tokenizer(w, model_dir, cfg)
    else:
        _add_spm(w, spm)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for layer, kind, stack in _stacked_experts(tensors, cfg.get("num_experts", 0)):
        w.add_tensor(f"blk.{layer}.{_EXPERTS[kind]}.weight", stack)
    for name, tensor in sorted(tensors.items()):
        if ".mlp.experts." in name:
            continue
        kind = name.split(".")[-2]
        if layout.permuted_qk and kind in ("q_proj", "k_proj") and name.endswith(".weight"):
            tensor = hf_to_gguf_rows(tensor, heads if kind == "q_proj" else kv)
        if layout.norm_shift and name.endswith("norm.weight"):
            tensor = tensor + np.float32(layout.norm_shift)
        w.add_tensor(gguf_name(name, arch), np.ascontiguousarray(tensor, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _stacked_experts(tensors: dict, experts: int):
    """(layer, projection, [E, out, in] float32) for every layer's routed experts."""
    layers = sorted({int(n.split(".")[2]) for n in tensors if ".mlp.experts." in n})
    for layer in layers:
        for kind in _EXPERTS:
            yield layer, kind, np.ascontiguousarray(np.stack(
                [tensors[f"model.layers.{layer}.mlp.experts.{e}.{kind}.weight"] for e in range(experts)]), np.float32)


def _add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, cfg: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)


def _add_spm(w: gguf.GGUFWriter, meta: dict) -> None:
    """A SentencePiece vocabulary as convert_hf_to_gguf.py's _set_vocab_sentencepiece writes it."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
