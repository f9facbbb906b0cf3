"""A tiny random-weight Qwen3 (dense) checkpoint in the HF layout, for tests (NumPy + safetensors only).

What a Qwen3 download holds, shrunk: ``config.json`` (``Qwen3ForCausalLM``, ``head_dim`` 32 while hidden / heads is
16, no attention bias, the head tied to the embedding as the small Qwen3 sizes ship), ``model.safetensors`` with the
released parameter names (``self_attn.q_norm`` / ``k_norm`` of ``head_dim`` values per layer, no ``lm_head``), the
byte-level BPE tokenizer of ``tests/support/tiny_model.py`` (``tokenizer.json``, ``tokenizer_config.json`` with a
ChatML template) and a MindFormers-style predict yaml. Same arguments, byte-identical files.

    python -m tests.support.make_tiny_qwen3 OUT_DIR [--seed N]
"""
from __future__ import annotations

from pathlib import Path

from tests.support import tiny_checkpoint
from tests.support.tiny_checkpoint import Layout, random_weights, tokenizer_config

ARCH = "Qwen3ForCausalLM"
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # != hidden_size / num_attention_heads, as in Qwen3-0.6B (1024 / 16 heads, head_dim 128)
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
}
LAYOUT = Layout(SHAPE)  # the Llama layer with q/k head norms; norm weights (the head norms too) 1 + noise
DEFAULT_SEED = 30
VOCAB = 384


def make_tiny_qwen3(out_dir: str | Path, *, seed: int = DEFAULT_SEED) -> Path:
    """Write a complete tiny Qwen3 model directory and return its path."""
    return tiny_checkpoint.write_checkpoint(
        out_dir, vocab_size=VOCAB, weights=lambda vocab: random_weights(vocab, seed, LAYOUT), config=hf_config,
        tokenizer_config=lambda ids: {**tokenizer_config(ids), "tokenizer_class": "Qwen2TokenizerFast"},
        yaml_name="predict_tiny_qwen3.yaml", yaml=predict_yaml)


def hf_config(vocab: int, ids: dict[str, int], *, arch: str = ARCH, shape: dict = SHAPE,
              moe: dict | None = None) -> dict:
    """config.json; with ``moe`` (make_tiny_qwen3_moe.MOE) Qwen3-MoE's: model_type qwen3_moe, the MoE keys after
    the sizes, the router-loss keys before rope_scaling."""
    return {
        "architectures": [arch],
        "model_type": "qwen3_moe" if moe else "qwen3",
        **shape,
        **(moe or {}),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape["num_hidden_layers"],
        **({"output_router_logits": False, "router_aux_loss_coef": 0.001} if moe else {}),
        "rope_scaling": None,
        **tiny_checkpoint.config_tail(ids),
    }


def yaml_fields(vocab: int, shape: dict = SHAPE) -> str:
    """The predict yaml's Qwen3 lines of model_config after the sizes (Qwen3-MoE's after its MoE lines)."""
    return f"""\
    vocab_size: {vocab}
    rms_norm_eps: 1.0e-6
    theta: {shape["rope_theta"]}
    max_position_embedding: {shape["max_position_embeddings"]}
    qkv_has_bias: false
    qk_layernorm: true
    tie_word_embeddings: true
"""


def predict_yaml(vocab: int, ids: dict[str, int]) -> str:
    return tiny_checkpoint.predict_yaml(ARCH, "make_tiny_qwen3.py", "Qwen3Config", SHAPE, yaml_fields(vocab), ids)


def main() -> None:
    tiny_checkpoint.main(__doc__, make_tiny_qwen3, DEFAULT_SEED)


if __name__ == "__main__":
    main()
