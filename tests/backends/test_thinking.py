"""thinking_budget's processor on hand-written token histories: it forces the closing token once the block
holds the budget, and only then."""
from __future__ import annotations

import numpy as np
import pytest

from backends.errors import ParameterRejected
from backends.thinking import thinking_budget

OPEN, CLOSE, V = 7, 8, 10
IDS = {"<think>": OPEN, "</think>": CLOSE}


def forced(prompt: list[int], generated: list[int], budget: int) -> bool:
    (processor,) = thinking_budget(budget, prompt, IDS.get)
    logits = processor(np.zeros(V), np.array(prompt + generated))
    return bool(np.isneginf(np.delete(logits, CLOSE)).all() and np.isfinite(logits[CLOSE]))


@pytest.mark.parametrize("prompt, generated, budget, expected", [
    ([1, 2], [OPEN, 3, 3], 3, False),  # two tokens of thought, budget three
    ([1, 2], [OPEN, 3, 3, 3], 3, True),  # three: close now
    ([1, 2], [OPEN, 3, 3, 3, CLOSE, 4], 3, False),  # closed already
    ([1, 2], [3, 3, 3, 3], 3, False),  # never opened
    ([1, OPEN], [3, 3], 2, True),  # the prompt opened it
    ([1, OPEN, 5, CLOSE], [3, 3, 3], 1, False),  # the prompt closed it (thinking off)
    ([1, OPEN], [], 0, True),  # budget 0: close at once
])
def test_the_budget_closes_the_block(prompt, generated, budget, expected):
    assert forced(prompt, generated, budget) == expected


def test_no_budget_adds_no_processor_and_missing_markers_are_refused():
    assert thinking_budget(None, [1], IDS.get) == []
    with pytest.raises(ParameterRejected) as caught:
        thinking_budget(3, [1], {}.get)
    assert caught.value.param == "thinking_budget"


def test_a_close_the_grammar_forbids_is_not_forced():
    (processor,) = thinking_budget(0, [OPEN], IDS.get)
    logits = np.zeros(V)
    logits[CLOSE] = -np.inf
    assert np.isfinite(processor(logits, np.array([OPEN]))).sum() == V - 1
