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

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from tests.support.make_tiny_gemma3 import DEFAULT_SEED, make_tiny_gemma3
from tests.support.paths import GOLDEN_DIR

GOLDEN = GOLDEN_DIR / "gemma3_tiny.json"
NEW_TOKENS = 20
LOGIT_STEPS = (0, 1, 7, 15, 19)  # greedy steps whose full logits are kept (step 0: the prompt's last position)
PROMPTS = {
    "greeting": [{"role": "user", "content": "Hello! How are you today?"}],
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "story": [{"role": "user", "content": "Please write a short story about a cat, a dog and a bird."},
              {"role": "assistant", "content": "Once upon a time there was a little robot."},
              {"role": "user", "content": "Count the waves: one, two, three, 12, 345 and 2024."}],
}


def _r(values) -> list[float]:
    return [round(float(v), 6) for v in values]


def model_golden(model_dir: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Gemma3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    # the same weights with a window longer than any prompt: the golden ids must differ (the window matters)
    unwindowed = Gemma3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager",
                                                   sliding_window=4096).eval()
    prompts = {}
    for name, messages in PROMPTS.items():
        chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            full = model(torch.tensor([ids])).logits[0].numpy()
            seq, greedy, steps = list(ids), [], []
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([seq])).logits[0, -1].numpy()
                steps.append(logits)
                greedy.append(int(np.argmax(logits)))
                seq.append(greedy[-1])
        positions = sorted({0, len(ids) // 2, len(ids) - 2})
        without = unwindowed.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
        prompts[name] = {
            "chat": chat, "input_ids": ids, "greedy_ids": greedy,
            "greedy_ids_without_window": [int(i) for i in without],
            "prompt_logits": {"positions": positions, "values": [_r(full[p]) for p in positions]},
            "step_logits": {"steps": list(LOGIT_STEPS), "values": [_r(steps[s]) for s in LOGIT_STEPS]},
        }
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {GOLDEN.relative_to(GOLDEN_DIR.parent.parent)}")
    args = parser.parse_args()
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        prompts = model_golden(make_tiny_gemma3(Path(tmp) / "gemma3", seed=DEFAULT_SEED))
    made_by = f"transformers {transformers.__version__}, torch {torch.__version__}, float32, eager attention"
    golden = {"made_by": made_by,
              "seed": DEFAULT_SEED, "new_tokens": NEW_TOKENS, "prompts": prompts}
    for name, p in prompts.items():
        print(f"{name}: {len(p['input_ids'])} prompt ids, greedy {p['greedy_ids']}")
    if args.write:
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
