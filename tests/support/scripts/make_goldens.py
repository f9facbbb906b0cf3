"""Recompute tests/golden/smollm2_greedy.json with the NumPy reference; writes only with --regenerate.

    python -m tests.support.scripts.make_goldens --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf [--regenerate]

Without --regenerate it prints the diff between the stored and the recomputed golden and exits 1 if they
differ. It never writes ids that disagree with HF transformers fp32's published ids.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

import numpy as np

from tests.support.paths import GOLDEN_DIR
from tests.support.reference_numpy import RefModel

GOLDEN = GOLDEN_DIR / "smollm2_greedy.json"
PROMPT = "My name is Olivier and I"
PROMPT_IDS = [5965, 1462, 314, 11256, 380, 1153, 284, 339]  # no BOS, as the model's tokenizer does
NEW_TOKENS = 20
# HF transformers 5.24 fp32, greedy, run once outside this repository (no torch here).
PUBLISHED_HF_FP32_IDS = [
    5248, 1535, 288, 724, 346, 351, 469, 1861, 30, 339, 3060, 325, 469, 685, 29, 1141, 1055, 288, 2381, 469,
]
PUBLISHED_TEXT = "'m here to help you with your business. I'll be your go-to person to ensure your"
SOURCE = (
    "numpy reference tests/reference_numpy.py on the Q4_1 GGUF dequantised, float64; "
    "matches HF fp32 published ids"
)


def compute(gguf: Path, cache_dir: Path | None = None) -> tuple[dict, np.ndarray]:
    """The golden record and the top1 - top2 logit margin at each generated position."""
    model = RefModel.from_gguf(gguf, dtype=np.float64, cache_dir=cache_dir)
    generated = model.greedy(PROMPT_IDS, NEW_TOKENS)
    logits = model.logits(PROMPT_IDS + generated[:-1])[len(PROMPT_IDS) - 1 :]  # [NEW_TOKENS, V]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    golden = {
        "prompt": PROMPT,
        "prompt_ids": PROMPT_IDS,
        "generated_ids": generated,
        "generated_text": PUBLISHED_TEXT,
        "source": SOURCE,
    }
    return golden, top2[:, 1] - top2[:, 0]


def render(golden: dict) -> str:
    """One field per line, id lists kept on one line so diffs stay readable."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in golden.items())
    return "{\n" + body + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--cache-dir", type=Path, help="keep dequantised weights here between runs")
    parser.add_argument("--regenerate", action="store_true", help="write the golden file")
    args = parser.parse_args(argv)

    golden, margins = compute(args.gguf, args.cache_dir)
    print(f"top1-top2 margins: min {margins.min():.4f} at index {int(margins.argmin())}; "
          f"first five {np.round(margins[:5], 4).tolist()}", file=sys.stderr)
    if golden["generated_ids"] != PUBLISHED_HF_FP32_IDS:
        print(f"reference ids {golden['generated_ids']} differ from HF fp32 {PUBLISHED_HF_FP32_IDS}; "
              "refusing to treat them as golden", file=sys.stderr)
        return 2

    new = render(golden)
    old = GOLDEN.read_text(encoding="utf-8") if GOLDEN.exists() else ""
    if args.regenerate:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(new, encoding="utf-8")
        print(f"wrote {GOLDEN}", file=sys.stderr)
        return 0
    diff = list(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "stored", "recomputed"))
    if not diff:
        print(f"{GOLDEN.name} is up to date", file=sys.stderr)
        return 0
    sys.stdout.writelines(diff)
    print("golden differs; not written (pass --regenerate to write it)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
