"""The HF transformers goldens of the tiny checkpoints (tests/golden/<family>_tiny.json, written by
tests/support/scripts/make_<family>_goldens.py): their prompt names, reading one, and the greedy parameters that
reproduce it."""
from __future__ import annotations

import json

from backends.types import RequestParams
from tests.support.paths import GOLDEN_DIR

NAMES = ("greeting", "capital", "story")


def load_golden(file_name: str) -> dict:
    return json.loads((GOLDEN_DIR / file_name).read_text(encoding="utf-8"))


def greedy_params(golden: dict, **extra) -> RequestParams:
    """Greedy over the golden length (no golden id is EOS; ignore_eos would ban it and move the logprobs)."""
    return RequestParams(max_new_tokens=golden["new_tokens"], do_sample=False, **extra)
