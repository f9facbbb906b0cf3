"""A tiny random-weight Qwen3-MoE checkpoint in the HF layout, for tests (NumPy + safetensors only).

What a Qwen3-MoE download holds, shrunk: ``config.json`` (``Qwen3MoeForCausalLM``: 8 experts, 2 routed per token,
normalised top-k probabilities, ``mlp_only_layers`` [1] so one layer keeps a dense MLP), ``model.safetensors`` with
the released parameter names (``mlp.gate`` the router [experts, hidden], ``mlp.experts.{i}.gate_proj`` / ``up_proj``
/ ``down_proj`` per expert, the q/k head norms of Qwen3, no ``lm_head``), the tokenizer files of
tests/support/make_tiny_qwen3.py and a MindFormers-style predict yaml. Same arguments, byte-identical files.

    python -m tests.support.make_tiny_qwen3_moe OUT_DIR [--seed N]
"""
from __future__ import annotations

from pathlib import Path

from tests.support import make_tiny_qwen3, tiny_checkpoint
from tests.support.tiny_checkpoint import Experts, Layout, random_weights, tokenizer_config

ARCH = "Qwen3MoeForCausalLM"
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,  # the dense (mlp_only) layers' MLP
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
}
MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,  # whole GGUF blocks of 32 in the experts' down rows
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}
DEFAULT_SEED = 31
VOCAB = 384


def sparse_layers(mlp_only: list[int]) -> list[int]:
    """The layers with routed experts (HF's rule: not in mlp_only_layers, and (i + 1) % decoder_sparse_step == 0)."""
    return [i for i in range(SHAPE["num_hidden_layers"])
            if i not in mlp_only and (i + 1) % MOE["decoder_sparse_step"] == 0]


def make_tiny_qwen3_moe(out_dir: str | Path, *, seed: int = DEFAULT_SEED, mlp_only: list[int] | None = None) -> Path:
    """Write a complete tiny Qwen3-MoE model directory and return its path. ``mlp_only``: the dense layers (default
    MOE's [1]; [] gives every layer experts, as llama.cpp's qwen3moe requires)."""
    moe = MOE if mlp_only is None else {**MOE, "mlp_only_layers": list(mlp_only)}
    return tiny_checkpoint.write_checkpoint(
        out_dir, vocab_size=VOCAB, weights=lambda vocab: random_weights(vocab, seed, layout(moe["mlp_only_layers"])),
        config=lambda vocab, ids: hf_config(vocab, ids, moe),
        tokenizer_config=lambda ids: {**tokenizer_config(ids), "tokenizer_class": "Qwen2TokenizerFast"},
        yaml_name="predict_tiny_qwen3_moe.yaml", yaml=lambda vocab, ids: predict_yaml(vocab, ids, moe))


def layout(mlp_only: list[int]) -> Layout:
    """Qwen3's layer with routed experts on the sparse layers: norm weights 1 + noise; a router of spread-out logits,
    so each token's top-2 experts are clear winners and differ between tokens."""
    return Layout(SHAPE, experts=Experts(MOE["num_experts"], MOE["moe_intermediate_size"],
                                         tuple(sparse_layers(mlp_only))))


def hf_config(vocab: int, ids: dict[str, int], moe: dict) -> dict:
    return make_tiny_qwen3.hf_config(vocab, ids, arch=ARCH, shape=SHAPE, moe=moe)


def predict_yaml(vocab: int, ids: dict[str, int], moe: dict) -> str:
    fields = f"""\
    num_experts: {moe["num_experts"]}
    num_experts_per_tok: {moe["num_experts_per_tok"]}
    moe_intermediate_size: {moe["moe_intermediate_size"]}
    norm_topk_prob: {str(moe["norm_topk_prob"]).lower()}
    decoder_sparse_step: {moe["decoder_sparse_step"]}
    mlp_only_layers: {moe["mlp_only_layers"]}
""" + make_tiny_qwen3.yaml_fields(vocab, SHAPE)
    return tiny_checkpoint.predict_yaml(ARCH, "make_tiny_qwen3_moe.py", "Qwen3MoeConfig", SHAPE, fields, ids)


def main() -> None:
    tiny_checkpoint.main(__doc__, make_tiny_qwen3_moe, DEFAULT_SEED)


if __name__ == "__main__":
    main()
