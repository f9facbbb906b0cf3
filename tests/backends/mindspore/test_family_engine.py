"""Every family with an HF transformers golden (tests/support/families.py: GOLDEN) behind the engine, on its tiny
random checkpoint: the golden greedy ids through ``Engine.submit`` on both kernel paths, the logprobs of the prompt
and of the greedy steps from HF's logits within 1e-4, and the three prompts admitted together giving what each gives
alone. A family that declares sliding-window layers has goldens its window decides (the tiny Gemma 3's window of 8
tokens is shorter than every prompt)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.families import GOLDEN
from tests.support.golden_prompts import NAMES, greedy_params, load_golden

pytestmark = pytest.mark.slow  # every test but the window's compiles the network


@pytest.fixture(scope="module", params=GOLDEN, ids=str)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def golden(family) -> dict:
    return load_golden(family.checkpoint.golden)


@pytest.fixture(scope="module", params=["stock", "aot"])
def engine(request, family):
    """The family's tiny checkpoint on a small engine, once per kernel path."""
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64,
                          block_size=16, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4),
                          kernels=request.param, threads=2)
    with Engine(request.getfixturevalue(family.checkpoint.fixture), config) as engine:
        yield engine


def _ids(result) -> list[int]:
    return [t.id for t in result.tokens]


def _log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.parametrize("name", NAMES)
def test_engine_gives_the_golden_greedy_ids(engine, golden, name):
    want = golden["prompts"][name]
    result = engine.submit(want["chat"], greedy_params(golden)).result(timeout=120)
    assert result.prompt_tokens == len(want["input_ids"])
    assert _ids(result) == want["greedy_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_engine_logprobs_equal_the_golden_logits(engine, golden, name):
    """decoder_input_details: each prompt token's logprob at the golden's prompt positions, and each golden step's
    token logprob, from HF's logits (log-softmax in float64) within 1e-4."""
    want = golden["prompts"][name]
    result = engine.submit(want["chat"], greedy_params(golden, decoder_input_details=True)).result(timeout=120)
    ids = want["input_ids"]
    assert [t.id for t in result.prefill] == ids and _ids(result) == want["greedy_ids"]
    for p, logits in zip(want["prompt_logits"]["positions"], want["prompt_logits"]["values"]):
        expected = _log_softmax(logits)[ids[p + 1]]
        assert abs(result.prefill[p + 1].logprob - expected) < 1e-4, (p, result.prefill[p + 1].logprob, expected)
    for step, logits in zip(want["step_logits"]["steps"], want["step_logits"]["values"]):
        expected = _log_softmax(logits)[want["greedy_ids"][step]]
        assert abs(result.tokens[step].logprob - expected) < 1e-4, (step, result.tokens[step].logprob, expected)


def test_prompts_batched_together_give_what_each_gives_alone(engine, golden):
    prompts = [golden["prompts"][n] for n in NAMES]
    alone = [engine.submit(p["chat"], greedy_params(golden)).result(timeout=120) for p in prompts]
    engine.allocator.prefix_caching = False  # every prompt computed again
    try:  # submitted between two steps: admitted together, prefilled and decoded in the same steps
        handles = engine._between_steps(lambda: [engine.submit(p["chat"], greedy_params(golden))
                                                 for p in prompts]).result(timeout=120)
        together = [h.result(timeout=120) for h in handles]
    finally:
        engine.allocator.prefix_caching = True
    for want, one, batched in zip(prompts, alone, together):
        assert _ids(batched) == _ids(one) == want["greedy_ids"]
        np.testing.assert_allclose([t.logprob for t in batched.tokens], [t.logprob for t in one.tokens], rtol=0,
                                   atol=1e-5)


@pytest.mark.parametrize("windowed", [t for t in GOLDEN if t.family.capabilities.sliding_window], ids=str)
def test_the_golden_prompts_exercise_the_window(windowed):
    """HF's greedy ids without the sliding window differ from the goldens on every prompt, each longer than the
    window: a network that ignored the window could not give them."""
    golden = load_golden(windowed.checkpoint.golden)
    for name in NAMES:
        p = golden["prompts"][name]
        assert len(p["input_ids"]) > windowed.checkpoint.sliding_window
        assert p["greedy_ids_without_window"] != p["greedy_ids"]
