"""Automatic prefix caching on real graphs: a prompt that starts with cached blocks skips their prefill and
its outputs (ids and logprobs) are bit-identical to those computed without the cache, on the tiny model
with both execution strategies and on the default model."""
from __future__ import annotations

from dataclasses import replace

import pytest

from backends.mindspore.engine.engine import Engine
from backends.settings import EngineConfig
from backends.types import GenerationResult, RequestParams

TINY = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=32, block_size=16,
                    prefill_chunk=16, window_buckets=(256,), batch_buckets=(1, 4))
SYSTEM = "the quick brown fox jumps over the lazy dog. " * 4
QUESTIONS = ["where is the fox now?", "and the dog sleeps", "once upon a time", "the end"]
GREEDY = RequestParams(max_new_tokens=10, do_sample=False)


def outputs(result: GenerationResult) -> list[tuple[int, float]]:
    return [(t.id, t.logprob) for t in result.tokens]


def run_all(engine: Engine, together: bool) -> list[list[tuple[int, float]]]:
    """The system prompt alone first (it fills the cache), then each question after it: one at a time, or
    all submitted at once (batched)."""
    first = [outputs(engine.generate(SYSTEM, GREEDY))]
    if together:
        handles = [engine.submit(SYSTEM + q, GREEDY) for q in QUESTIONS]
        return first + [outputs(h.result()) for h in handles]
    return first + [outputs(engine.generate(SYSTEM + q, GREEDY)) for q in QUESTIONS]


@pytest.mark.parametrize("kernels, together", [("aot", False), ("aot", True), ("stock", False)])
def test_tiny_outputs_are_bit_identical_with_and_without_the_cache(tiny_model_dir, kernels, together):
    results, info = {}, {}
    for caching in (False, True):
        with Engine(tiny_model_dir, replace(TINY, kernels=kernels, prefix_caching=caching)) as engine:
            assert engine.runner.kernels == kernels
            results[caching] = run_all(engine, together)
            info[caching] = engine.info()
    assert results[True] == results[False]
    assert info[False]["prefix_cache_hit_tokens"] == 0 and info[False]["prefix_cache_blocks"] == 0
    prompt = len(engine.tokenizer.encode(SYSTEM))
    # Each question shares the system prompt's full blocks (short of its last token).
    assert info[True]["prefix_cache_hit_tokens"] >= len(QUESTIONS) * ((prompt - 1) // 16 * 16) > 0
    assert 0 < info[True]["prefix_cache_hit_rate"] < 1 and info[True]["prefix_cache_blocks"] >= prompt // 16


@pytest.mark.parametrize("kernels, kv, together", [("aot", "float32", False), ("aot", "float16", True),
                                                   ("aot", "bfloat16", False), ("aot", "q8_0", True),
                                                   ("stock", "float32", False)])
def test_tiny_rows_copied_from_a_cached_block_give_bit_identical_outputs(tiny_model_dir, kernels, kv, together):
    """Blocks of 128 tokens, longer than the system prompt: what the questions reuse is the system prompt's
    parts of 16 rows, copied from its block into theirs (every KV format's rows, both strategies' caches)."""
    config = replace(TINY, kernels=kernels, kv_cache_dtype=kv, block_size=128)
    results, info = {}, {}
    for caching in (False, True):
        with Engine(tiny_model_dir, replace(config, prefix_caching=caching)) as engine:
            results[caching] = run_all(engine, together)
            info[caching] = engine.info()
    assert results[True] == results[False]
    prompt = len(engine.tokenizer.encode(SYSTEM))
    assert prompt < 128 and info[True]["prefix_cache_hit_tokens"] >= len(QUESTIONS) * ((prompt - 1) // 16 * 16) > 0


def test_default_model_outputs_are_bit_identical_with_the_prefix_skipped(default_engine):
    """A request asking for every prompt token's logprob prefills its whole prompt (no cache read): the same
    prompt answered from the cache gives the very same tokens and logprobs."""
    before = default_engine.info()["prefix_cache_hit_tokens"]
    default_engine.generate(SYSTEM * 2, GREEDY)  # fills the cache
    for question in QUESTIONS[:2]:
        cached = default_engine.generate(SYSTEM * 2 + question, GREEDY)
        full = default_engine.generate(SYSTEM * 2 + question, replace(GREEDY, decoder_input_details=True))
        assert outputs(cached) == outputs(full) and len(full.prefill) == cached.prompt_tokens
    assert default_engine.info()["prefix_cache_hit_tokens"] > before
