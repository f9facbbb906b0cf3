"""Qwen3-MoE behind the engine (the tiny random checkpoint, tests/support/make_tiny_qwen3_moe.py): HF transformers'
golden greedy ids (tests/golden/qwen3_moe_tiny.json) through ``Engine.submit`` on both kernel paths, the logprobs of
the prompt and of the greedy steps from HF's logits within 1e-4, and the three prompts admitted together giving what
each gives alone.
The checks are tests/support/hf_golden_engine.py's, collected here."""
from __future__ import annotations

import pytest

from tests.support.hf_golden_engine import engine_fixture, golden_fixture
from tests.support.hf_golden_engine import (
    check_engine_gives_the_golden_greedy_ids,
    check_engine_logprobs_equal_the_golden_logits,
    check_prompts_batched_together_give_what_each_gives_alone,
)


# hf_golden_engine's checks, collected as this module's tests
test_engine_gives_the_golden_greedy_ids = check_engine_gives_the_golden_greedy_ids
test_engine_logprobs_equal_the_golden_logits = check_engine_logprobs_equal_the_golden_logits
test_prompts_batched_together_give_what_each_gives_alone = check_prompts_batched_together_give_what_each_gives_alone

pytestmark = pytest.mark.slow  # every test compiles the network
golden = golden_fixture("qwen3_moe_tiny.json")
engine = engine_fixture("tiny_qwen3_moe_dir")
