"""Tiny random Llama/Qwen2 model directories for tests (tests/support/tiny_checkpoint.py writes them): HF-named
float32 safetensors, config.json, the byte-level BPE tokenizer, tokenizer_config.json and a predict yaml.

Weights are honest seeded randoms (nothing is biased against EOS); under them `<|im_end|>` is just one of
~384 tokens, so greedy runs usually go the full length. Same arguments → byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.support.tiny_checkpoint import (BOS, EOS, PAD, Layout, config_tail, random_weights, tokenizer_config,
                                          write_checkpoint)

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
}
# arch -> (architectures[0], model_type, q/k/v biases, a head tied to the embedding by default)
_ARCH = {"llama": ("LlamaForCausalLM", "llama", False, True), "qwen2": ("Qwen2ForCausalLM", "qwen2", True, False)}


def layout(arch: str, tie: bool) -> Layout:
    """Llama's decoder (no biases, no head norms; every weight of spread 0.1); Qwen2's adds the q/k/v biases."""
    return Layout(SHAPE, std=0.1, qk_norm=False, qkv_bias=_ARCH[arch][2], tied=tie)


def make_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    arch: str = "llama",
    tie: bool | None = None,
    vocab: int | None = None,
) -> Path:
    """Write a complete tiny model directory and return its path.

    arch "llama": no biases, tied head by default. arch "qwen2": q/k/v biases, separate lm_head by default.
    vocab: target tokenizer vocab size (default 384, specials included); config vocab_size is the
    trained tokenizer's actual size.
    """
    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {sorted(_ARCH)}, got {arch!r}")
    tie = _ARCH[arch][3] if tie is None else tie
    bias = layout(arch, tie).qkv_bias
    return write_checkpoint(
        out_dir, vocab_size=vocab or 384, weights=lambda v: random_weights(v, seed, layout(arch, tie)),
        config=lambda v, ids: _config(arch, v, tie, ids), tokenizer_config=tokenizer_config,
        yaml_name="predict_tiny.yaml", yaml=lambda v, ids: _predict_yaml(v, bias, tie, ids))


def _config(arch: str, vocab_size: int, tie: bool, ids: dict[str, int]) -> dict:
    architecture, model_type, bias, _ = _ARCH[arch]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        **SHAPE,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        # Qwen2 semantics: bias on q/k/v only (o_proj never has one here).
        "attention_bias": bias,
        "tie_word_embeddings": tie,
        **config_tail(ids),
    }


def _predict_yaml(vocab_size: int, qkv_bias: bool, tie: bool, ids: dict[str, int]) -> str:
    def b(flag: bool) -> str:
        return "true" if flag else "false"

    return f"""\
run_mode: predict
load_checkpoint: model.safetensors
load_ckpt_format: safetensors
context: {{mode: 0, device_target: CPU}}
model:
  arch: {{type: LlamaForCausalLM}}
  model_config:
    type: LlamaConfig
    seq_length: {SHAPE["max_position_embeddings"]}
    hidden_size: {SHAPE["hidden_size"]}
    num_layers: {SHAPE["num_hidden_layers"]}
    num_heads: {SHAPE["num_attention_heads"]}
    n_kv_heads: {SHAPE["num_key_value_heads"]}
    intermediate_size: {SHAPE["intermediate_size"]}
    vocab_size: {vocab_size}
    rms_norm_eps: 1.0e-6
    theta: 10000.0
    max_position_embedding: {SHAPE["max_position_embeddings"]}
    qkv_has_bias: {b(qkv_bias)}
    tie_word_embeddings: {b(tie)}
    bos_token_id: {ids[BOS]}
    eos_token_id: {ids[EOS]}
    pad_token_id: {ids[PAD]}
    compute_dtype: float32
    param_init_type: float32
    use_past: true
processor:
  return_tensors: ms
  tokenizer: {{type: PreTrainedTokenizerFast, tokenizer_file: tokenizer.json}}
"""


def quantized_copy(src: str | Path, out_dir: str | Path, fmt: str, formats: dict[str, str] | None = None) -> Path:
    """A copy of the model directory `src` with every matrix (the projections, the embedding, the head) stored
    as GGUF `fmt` blocks, the way ``convert-gguf --dtype`` writes them: uint8 [rows, row bytes], the safetensors
    metadata ``mindserve.quantization`` naming each, and the predict yaml's ``weight_dtype``. The
    32-block formats are quantized by the `gguf` package, the K-quants (which it cannot write) by
    ``quant.quantize``. ``formats`` maps a name suffix (``self_attn.v_proj.weight``) to another format for the
    matrices ending so (a mix like llama-quantize's Q4_K_M: the yaml then says ``mixed``). Returns out_dir."""
    import shutil

    from safetensors.numpy import load_file

    from backends.mindspore.modeldir.quant import layers_format, quantize

    formats = formats or {}
    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    tensors, names = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if w.ndim == 2:
            f = next((v for k, v in formats.items() if name.endswith(k)), fmt)
            tensors[name] = np.ascontiguousarray(quantize(w, f).blocks)
            names[name] = f
        else:
            tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"),
              metadata={"format": "pt", "mindserve.quantization": json.dumps(names, sort_keys=True)})
    dtype = layers_format(names)
    for y in out.glob("*.yaml"):
        y.write_text(y.read_text().replace("  model_config:\n", f"  model_config:\n    weight_dtype: {dtype}\n", 1))
    return out
