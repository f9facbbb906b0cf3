"""The checks shared by the engine tests of an architecture against its HF transformers golden
(tests/golden/<arch>_tiny.json, written by tests/support/scripts/make_<arch>_goldens.py): the golden greedy ids
through ``Engine.submit`` on both kernel paths, the logprobs of the prompt and of the greedy steps from HF's logits
within 1e-4, and the three prompts admitted together giving what each gives alone.

A test module declares its ``golden`` and ``engine`` fixtures with :func:`golden_fixture` and
:func:`engine_fixture` and imports the ``test_*`` functions below, which pytest then collects in that module."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backends.types import RequestParams
from tests.support.paths import GOLDEN_DIR

NAMES = ("greeting", "capital", "story")


def load_golden(file_name: str) -> dict:
    return json.loads((GOLDEN_DIR / file_name).read_text(encoding="utf-8"))


def golden_fixture(file_name: str):
    """A module-scoped ``golden`` fixture: the parsed tests/golden/``file_name``."""
    @pytest.fixture(scope="module", name="golden")
    def golden() -> dict:
        return load_golden(file_name)
    return golden


def engine_fixture(checkpoint_fixture: str):
    """A module-scoped ``engine`` fixture, once per kernel path, over the checkpoint directory that the fixture named
    ``checkpoint_fixture`` gives."""
    @pytest.fixture(scope="module", name="engine", params=["stock", "aot"])
    def engine(request):
        from backends.mindspore.engine.engine import Engine
        from backends.settings import EngineConfig

        config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64,
                              block_size=16, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4),
                              kernels=request.param, threads=2)
        with Engine(request.getfixturevalue(checkpoint_fixture), config) as engine:
            yield engine
    return engine


def greedy_params(golden: dict, **extra) -> RequestParams:
    """Greedy over the golden length (no golden id is EOS; ignore_eos would ban it and move the logprobs)."""
    return RequestParams(max_new_tokens=golden["new_tokens"], do_sample=False, **extra)


def _ids(result) -> list[int]:
    return [t.id for t in result.tokens]


def _log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.parametrize("name", NAMES)
def check_engine_gives_the_golden_greedy_ids(engine, golden, name):
    want = golden["prompts"][name]
    result = engine.submit(want["chat"], greedy_params(golden)).result(timeout=120)
    assert result.prompt_tokens == len(want["input_ids"])
    assert _ids(result) == want["greedy_ids"]


@pytest.mark.parametrize("name", NAMES)
def check_engine_logprobs_equal_the_golden_logits(engine, golden, name):
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


def check_prompts_batched_together_give_what_each_gives_alone(engine, golden):
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
