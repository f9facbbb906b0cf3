"""The whole network on every kernel build variant this machine runs: the same greedy tokens and the very same
logits bits on the tiny model (scalar included) and on the default model (the SIMD variants)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.kernel_variants import HOST_VARIANTS, NATIVE, SIMD_VARIANTS, skip_unless_runs
from tests.support.runner import greedy, make_runner, prompt

pytestmark = pytest.mark.slow


def _run(model_dir, variant: str, steps: int):
    runner = make_runner(model_dir, kernels="aot", kernel_isa=variant)
    assert runner.kernel_variant["variant"] == variant
    ids = prompt(11, 5, runner.spec.vocab_size)  # two prompt chunks of 8, the second one partial
    return greedy(runner, ids, steps, [1, 2])


@pytest.fixture(scope="module")
def tiny_native(tiny_model_dir):
    return _run(tiny_model_dir, NATIVE, 12)


@pytest.mark.parametrize("variant", [v for v in HOST_VARIANTS if v != NATIVE])
def test_tiny_model_gives_the_native_tokens_and_logits_bits(tiny_model_dir, tiny_native, variant):
    skip_unless_runs(variant)
    tokens, logits = _run(tiny_model_dir, variant, 12)
    assert tokens == tiny_native[0]
    assert np.array_equal(logits.view(np.uint32), tiny_native[1].view(np.uint32))


@pytest.fixture(scope="module")
def gemma3_native(tiny_gemma3_dir):
    return _run(tiny_gemma3_dir, NATIVE, 12)


@pytest.mark.parametrize("variant", [v for v in HOST_VARIANTS if v != NATIVE])
def test_tiny_gemma3_gives_the_native_tokens_and_logits_bits(tiny_gemma3_dir, gemma3_native, variant):
    """Gemma 3's layer op, window (11 prompt tokens against a window of 8) and GeGLU on every variant."""
    skip_unless_runs(variant)
    tokens, logits = _run(tiny_gemma3_dir, variant, 12)
    assert tokens == gemma3_native[0]
    assert np.array_equal(logits.view(np.uint32), gemma3_native[1].view(np.uint32))


@pytest.fixture(scope="module")
def default_native(default_model_dir):
    return _run(default_model_dir, NATIVE, 8)


@pytest.mark.parametrize("variant", [v for v in SIMD_VARIANTS if v != NATIVE])
def test_default_model_gives_the_native_tokens_and_logits_bits(default_model_dir, default_native, variant):
    skip_unless_runs(variant)
    want_tokens, want = default_native
    tokens, logits = _run(default_model_dir, variant, 8)
    assert tokens == want_tokens
    assert np.array_equal(logits.view(np.uint32), want.view(np.uint32))
