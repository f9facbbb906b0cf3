"""Goldens for the Gemma 3 tests, from the reference implementation (HF transformers' ``Gemma3ForCausalLM`` and its
tokenizer classes on the tiny checkpoint of tests/support/make_tiny_gemma3.py), run once in a separate
environment: torch and transformers are not dependencies of the project.

    python3 -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch transformers safetensors numpy
    /tmp/hfenv/bin/python -m tests.support.scripts.make_gemma3_goldens --write

Writes tests/golden/gemma3_tiny.json: per prompt the chat text, HF's input_ids, the full-forward logits at a few
prompt positions, NEW_TOKENS greedy ids (argmax of a full forward pass over the prompt and the ids so far, no
cache, EOS not special), the logits of a few greedy steps, and the greedy ids of the same weights without the sliding
window (``greedy_ids_without_window``: that they differ shows the window is exercised). Without --write it only
prints a summary.
"""
from __future__ import annotations

from pathlib import Path

from tests.support.make_tiny_gemma3 import DEFAULT_SEED, make_tiny_gemma3
from tests.support.paths import GOLDEN_DIR
from tests.support.scripts import hf_goldens
from tests.support.scripts.hf_goldens import NEW_TOKENS, prompt_goldens

GOLDEN = GOLDEN_DIR / "gemma3_tiny.json"


def model_golden(model_dir: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Gemma3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    # the same weights with a window longer than any prompt: the golden ids must differ (the window matters)
    unwindowed = Gemma3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager",
                                                   sliding_window=4096).eval()

    def without_window(ids: list[int]) -> dict:
        without = unwindowed.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
        return {"greedy_ids_without_window": [int(i) for i in without]}

    return prompt_goldens(tokenizer, model, without_window)


def main() -> None:
    hf_goldens.main(__doc__.splitlines()[0], GOLDEN, GOLDEN_DIR, make_tiny_gemma3, "gemma3", DEFAULT_SEED,
                    model_golden)


if __name__ == "__main__":
    main()
