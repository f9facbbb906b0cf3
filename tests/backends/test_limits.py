"""The engine's limits and compiled shapes from its settings (pure arithmetic: no model, no MindSpore)."""
from __future__ import annotations

import pytest

from backends.limits import PromptLimit, longest_sequence, prompt_token_limit
from backends.mindspore.planning.shapes import ShapeError, plan_shapes
from backends.settings import EngineConfig


@pytest.mark.parametrize("max_input, max_seq, max_pos, want", [
    (2048, 2560, 8192, PromptLimit(2048, "maxInputTokenLen")),
    (4096, 1024, 8192, PromptLimit(1023, "maxSeqLen - 1")),
    (4096, 8192, 512, PromptLimit(511, "max_position_embeddings - 1")),  # room for one new token
    (4096, 8192, None, PromptLimit(4096, "maxInputTokenLen")),  # the model not known yet
    (100, 64, None, PromptLimit(63, "maxSeqLen - 1")),
    (4194304, 4194305, None, PromptLimit(1048576, "the hard cap")),
])
def test_prompt_token_limit(max_input, max_seq, max_pos, want):
    assert prompt_token_limit(EngineConfig(max_input_tokens=max_input, max_seq_len=max_seq), max_pos) == want


@pytest.mark.parametrize("max_seq, max_pos, want", [(2048, None, 2048), (2048, 8192, 2048), (2048, 512, 512)])
def test_longest_sequence(max_seq, max_pos, want):
    assert longest_sequence(EngineConfig(max_seq_len=max_seq), max_pos) == want


BASE = EngineConfig(max_seq_len=1000, max_batch_size=12, block_size=16, prefill_chunk=64, max_prefill_batch=4)


@pytest.mark.parametrize("config, max_pos, want", [
    (BASE, None, dict(batch_buckets=(1, 2, 4, 8, 12), window_buckets=(256, 1008), prefill_batch_buckets=(1, 4),
                      prefill_chunk=64)),
    (BASE, 100, dict(window_buckets=(112,), prefill_chunk=64)),  # the model caps the longest sequence
    (EngineConfig(max_seq_len=40, block_size=16, prefill_chunk=64), None, dict(window_buckets=(48,), prefill_chunk=48)),
    (EngineConfig(max_seq_len=64, max_batch_size=4, block_size=16, batch_buckets=(4, 1), window_buckets=(64, 32)),
     None, dict(batch_buckets=(1, 4), window_buckets=(32, 64))),
])
def test_plan_shapes(config, max_pos, want):
    shapes = plan_shapes(config, max_pos)
    assert {key: getattr(shapes, key) for key in want} == want


@pytest.mark.parametrize("config, max_pos, key, message", [
    (EngineConfig(max_batch_size=16, batch_buckets=(1, 4)), None, "batchBuckets",
     "batchBuckets [1, 4]: the largest must be >= maxBatchSize 16"),
    (EngineConfig(block_size=128, window_buckets=(200, 2560)), None, "windowBuckets",
     "windowBuckets [200, 2560]: 200 is not a multiple of cacheBlockSize 128"),
    (EngineConfig(max_seq_len=2048, block_size=16, window_buckets=(1024,)), None, "windowBuckets",
     "windowBuckets [1024]: the largest must be >= 2048, the longest sequence; raise it or lower maxSeqLen"),
    (EngineConfig(max_seq_len=10_000, block_size=16, window_buckets=(512,)), 1024, "windowBuckets",
     "the largest must be >= 1024, the longest sequence (the model's max_position_embeddings is 1024)"),
])
def test_plan_shapes_refuses_buckets_that_do_not_cover(config, max_pos, key, message):
    with pytest.raises(ShapeError) as caught:
        plan_shapes(config, max_pos)
    assert caught.value.key == key and message in str(caught.value)
