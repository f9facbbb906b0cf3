"""Goldens for the Qwen3-MoE tests, from the reference implementation (HF transformers' ``Qwen3MoeForCausalLM`` and its
tokenizer classes on the tiny checkpoint of tests/support/make_tiny_qwen3_moe.py), run once in a separate
environment: torch and transformers are not dependencies of the project.

    python3 -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch transformers safetensors numpy
    /tmp/hfenv/bin/python -m tests.support.scripts.make_qwen3_moe_goldens --write

Writes tests/golden/qwen3_moe_tiny.json: per prompt the chat text, HF's input_ids, the full-forward logits at a few
prompt positions, NEW_TOKENS greedy ids (argmax of a full forward pass over the prompt and the ids so far, no
cache, EOS not special) and the logits of a few greedy steps. Without --write it only prints a summary.
"""
from __future__ import annotations

from pathlib import Path

from tests.support.make_tiny_qwen3_moe import DEFAULT_SEED, make_tiny_qwen3_moe
from tests.support.paths import GOLDEN_DIR
from tests.support.scripts import hf_goldens
from tests.support.scripts.hf_goldens import prompt_goldens

GOLDEN = GOLDEN_DIR / "qwen3_moe_tiny.json"


def model_golden(model_dir: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, info = Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager",
                                                      output_loading_info=True)
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise SystemExit(f"the checkpoint did not load as it is: {info}")  # the experts, routers, head norms all read
    model.eval()
    return prompt_goldens(tokenizer, model)


def main() -> None:
    hf_goldens.main(__doc__.splitlines()[0], GOLDEN, GOLDEN_DIR, make_tiny_qwen3_moe, "qwen3_moe", DEFAULT_SEED,
                    model_golden)


if __name__ == "__main__":
    main()
