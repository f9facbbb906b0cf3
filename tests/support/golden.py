"""The greedy golden of the default model (tests/golden/smollm2_greedy.json, from the NumPy reference) and
the prompts the tests share."""
from __future__ import annotations

import json
import math
from typing import Any

from tests.support.paths import GOLDEN_DIR

NUMPY_GOLDEN = json.loads((GOLDEN_DIR / "smollm2_greedy.json").read_text(encoding="utf-8"))
PROMPT = "My name is Olivier and I"
PROMPT_IDS = [5965, 1462, 314, 11256, 380, 1153, 284, 339]  # the prompt of tests/golden/smollm2_greedy.json
GREEDY_TEXT = NUMPY_GOLDEN["generated_text"]  # 20 greedy tokens after PROMPT
EOS_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"  # greedy: 7 tokens, EOS last
LOGPROB_TOL = 1e-4


def assert_same(live: Any, golden: Any, where: str = "$") -> None:
    """Equal values and key order, except floats (logprobs): within LOGPROB_TOL."""
    if isinstance(golden, float) or isinstance(live, float):
        assert isinstance(live, (int, float)) and isinstance(golden, (int, float)), (where, live, golden)
        assert math.isclose(live, golden, rel_tol=0, abs_tol=LOGPROB_TOL), (where, live, golden)
    elif isinstance(golden, dict):
        assert isinstance(live, dict) and list(live) == list(golden), (where, live, golden)
        for key in golden:
            assert_same(live[key], golden[key], f"{where}.{key}")
    elif isinstance(golden, list):
        assert isinstance(live, list) and len(live) == len(golden), (where, live, golden)
        for i, (a, b) in enumerate(zip(live, golden)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert type(live) is type(golden) and live == golden, (where, live, golden)
