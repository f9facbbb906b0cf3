"""The writer shared by the HF-transformers golden scripts of the decoder-only architectures
(make_qwen3_goldens.py, make_qwen3_moe_goldens.py, make_gemma3_goldens.py): the prompts, per prompt the chat text,
HF's input_ids, the full-forward logits at a few prompt positions, NEW_TOKENS greedy ids (argmax of a full forward
pass over the prompt and the ids so far, no cache, EOS not special) and the logits of a few greedy steps, and the
command line (``--write``) that writes tests/golden/<arch>_tiny.json. Runs in the separate HF environment only."""
from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

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


def prompt_goldens(tokenizer, model, extra: Callable[[list[int]], dict[str, Any]] | None = None) -> dict:
    """Per prompt of PROMPTS: its golden entry from ``model`` (an HF causal LM, eval mode) and ``tokenizer``;
    ``extra(input_ids)`` gives keys written after ``greedy_ids``."""
    import torch

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
        prompts[name] = {
            "chat": chat, "input_ids": ids, "greedy_ids": greedy, **(extra(ids) if extra else {}),
            "prompt_logits": {"positions": positions, "values": [_r(full[p]) for p in positions]},
            "step_logits": {"steps": list(LOGIT_STEPS), "values": [_r(steps[s]) for s in LOGIT_STEPS]},
        }
    return prompts


def main(description: str, golden: Path, golden_dir: Path, make_checkpoint: Callable[..., Path], checkpoint_name: str,
         seed: int, model_golden: Callable[[Path], dict]) -> None:
    """The scripts' command line: ``model_golden`` over ``make_checkpoint(tmp / checkpoint_name, seed=seed)``, a
    summary printed, and with --write the golden file ``golden`` (shown relative to the tree above ``golden_dir``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write", action="store_true", help=f"write {golden.relative_to(golden_dir.parent.parent)}")
    args = parser.parse_args()
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        prompts = model_golden(make_checkpoint(Path(tmp) / checkpoint_name, seed=seed))
    made_by = f"transformers {transformers.__version__}, torch {torch.__version__}, float32, eager attention"
    document = {"made_by": made_by,
                "seed": seed, "new_tokens": NEW_TOKENS, "prompts": prompts}
    for name, p in prompts.items():
        print(f"{name}: {len(p['input_ids'])} prompt ids, greedy {p['greedy_ids']}")
    if args.write:
        golden.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {golden}")
