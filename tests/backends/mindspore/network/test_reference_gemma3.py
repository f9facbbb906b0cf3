"""The NumPy Gemma 3 reference (tests/support/reference_gemma3.py) against HF transformers' Gemma3ForCausalLM on the
tiny checkpoint (tests/golden/gemma3_tiny.json: a window of 8 tokens, shorter than every prompt; a linear rope factor
on the global layer; query_pre_attn_scalar != head_dim): the logits HF recorded and its greedy ids, with and without
the sliding window. NumPy only: not slow."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.support.golden_prompts import load_golden
from tests.support.make_tiny_gemma3 import make_tiny_gemma3
from tests.support.reference_gemma3 import Gemma3RefModel

TOL = 1e-4  # HF ran float32, the reference float64: measured worst 1.1e-6


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_golden("gemma3_tiny.json")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Gemma3RefModel:
    return Gemma3RefModel.from_dir(make_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3")))


@pytest.mark.parametrize("name", ["greeting", "capital", "story"])
def test_the_reference_gives_hf_transformers_logits_and_greedy_ids(reference, golden, name):
    want = golden["prompts"][name]
    logits = reference.logits(want["input_ids"])
    for pos, values in zip(want["prompt_logits"]["positions"], want["prompt_logits"]["values"]):
        np.testing.assert_allclose(logits[pos], values, rtol=0, atol=TOL)
    ids = want["input_ids"] + want["greedy_ids"]
    steps = reference.logits(ids[:-1])[len(want["input_ids"]) - 1:]
    for step, values in zip(want["step_logits"]["steps"], want["step_logits"]["values"]):
        np.testing.assert_allclose(steps[step], values, rtol=0, atol=TOL)
    assert reference.greedy(want["input_ids"], golden["new_tokens"]) == want["greedy_ids"]


def test_without_its_window_the_reference_gives_hf_greedy_ids_without_window(reference, golden):
    """HF's goldens made with a window of 4096 (longer than any prompt; the local layers keep their rope base) are what
    the reference gives with that window: the window is the one thing that separates the two goldens."""
    unwindowed = dataclasses.replace(reference.config, sliding_window=4096)
    model = Gemma3RefModel(unwindowed, reference.w)
    for name, want in golden["prompts"].items():
        got = model.greedy(want["input_ids"], golden["new_tokens"])
        assert got == want["greedy_ids_without_window"] != want["greedy_ids"], name
