"""A tiny random-weight Gemma 3 (text) checkpoint in the HF layout, for tests (NumPy + safetensors only).

What a ``Gemma3ForCausalLM`` download holds, shrunk: ``config.json`` (model_type ``gemma3_text``: layers 0, 1 and 3
sliding-window layers with a window of 8 tokens, shorter than the golden prompts, layer 2 a global layer; the local
rope base 10000 against the global 1e6 with a linear rope_scaling factor; ``query_pre_attn_scalar`` 24 while head_dim
is 32, so a network that scales by head_dim is caught; GeGLU with gelu_pytorch_tanh; the head tied to the embedding),
``model.safetensors`` with the released parameter names (four norms a layer, q/k head norms; Gemma's norms apply
``1 + weight``, so the weights are noise around 0), the byte-level BPE tokenizer of ``tests/support/tiny_model.py``
with a Gemma-style chat template (bos first, turns of ``user`` / ``model``) and a predict yaml. Same arguments,
byte-identical files.

    python -m tests.support.make_tiny_gemma3 OUT_DIR [--seed N]
"""
from __future__ import annotations

from pathlib import Path

from tests.support import tiny_checkpoint
from tests.support.tiny_checkpoint import Layout, random_weights, tokenizer_config

ARCH = "Gemma3ForCausalLM"
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
}
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
# What a gemma3 GGUF can say (llama.cpp's loader): every 6th layer global, the score scale from head_dim.
LLAMA_CPP = {"num_hidden_layers": 7, "query_pre_attn_scalar": SHAPE["head_dim"]}
LLAMA_CPP_LAYER_TYPES = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(7)]
ROPE_SCALING = {"rope_type": "linear", "factor": 2.0}  # on the global layers only (as Gemma 3 4B+ ship, factor 8)
DEFAULT_SEED = 34
VOCAB = 384
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|im_start|>' + role + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>model\\n' }}{% endif %}"
)


def make_tiny_gemma3(out_dir: str | Path, *, seed: int = DEFAULT_SEED, llama_cpp: bool = False) -> Path:
    """Write a complete tiny Gemma 3 text model directory and return its path; ``llama_cpp``: 7 layers in the
    pattern a GGUF implies (layer 5 global) and query_pre_attn_scalar = head_dim, for the llama-server agreement."""
    shape, types = ({**SHAPE, **LLAMA_CPP}, LLAMA_CPP_LAYER_TYPES) if llama_cpp else (SHAPE, LAYER_TYPES)
    return tiny_checkpoint.write_checkpoint(
        out_dir, vocab_size=VOCAB, weights=lambda vocab: random_weights(vocab, seed, layout(shape)),
        config=lambda vocab, ids: hf_config(vocab, ids, shape, types),
        tokenizer_config=lambda ids: {**tokenizer_config(ids), "chat_template": CHAT_TEMPLATE},
        yaml_name="predict_tiny_gemma3.yaml", yaml=lambda vocab, ids: predict_yaml(vocab, ids, shape, types))


def layout(shape: dict) -> Layout:
    """Gemma's layer: four norms (pre-/post-attention, pre-/post-feedforward) and the q/k head norms, their weights
    noise around 0 (Gemma scales by 1 + weight); a small embedding: the layers, not the (sqrt(hidden)-scaled) input
    row, drive the tied head's logits."""
    return Layout(shape, embed_std=0.02, norm_center=0.0,
                  ffn_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"))


def hf_config(vocab: int, ids: dict[str, int], shape: dict = SHAPE, layer_types: list[str] = LAYER_TYPES) -> dict:
    return {
        "architectures": [ARCH],
        "model_type": "gemma3_text",
        **shape,
        "vocab_size": vocab,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "layer_types": layer_types,
        "rope_scaling": ROPE_SCALING,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        **tiny_checkpoint.config_tail(ids),
    }


def predict_yaml(vocab: int, ids: dict[str, int], shape: dict = SHAPE, layer_types: list[str] = LAYER_TYPES) -> str:
    fields = f"""\
    vocab_size: {vocab}
    rms_norm_eps: 1.0e-6
    theta: {shape["rope_theta"]}
    rope_local_base_freq: {shape["rope_local_base_freq"]}
    rope_scaling: {{rope_type: {ROPE_SCALING["rope_type"]}, factor: {ROPE_SCALING["factor"]}}}
    sliding_window: {shape["sliding_window"]}
    layer_types: [{", ".join(layer_types)}]
    query_pre_attn_scalar: {shape["query_pre_attn_scalar"]}
    hidden_act: gelu_pytorch_tanh
    max_position_embedding: {shape["max_position_embeddings"]}
    qkv_has_bias: false
    tie_word_embeddings: true
"""
    return tiny_checkpoint.predict_yaml(ARCH, "make_tiny_gemma3.py", "Gemma3TextConfig", shape, fields, ids)


def main() -> None:
    tiny_checkpoint.main(__doc__, make_tiny_gemma3, DEFAULT_SEED)


if __name__ == "__main__":
    main()
