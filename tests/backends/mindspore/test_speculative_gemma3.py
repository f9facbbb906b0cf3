"""Speculative decoding on the real Gemma 3 270M (its Q4_K_M blocks as shipped), the model that copies: greedy
requests that repeat a passage, and free text, give the ids and logprobs of plain decoding (the same engine,
``speculate=False``) with the adaptive draft length and its pauses at work (the bench's settings: 8 draft tokens,
the packed sizes 1, 2, 4, 8 a verify step runs), and most drafts of the copied passages are accepted."""
from __future__ import annotations

from dataclasses import replace

import pytest

from backends.mindspore.engine.engine import Engine
from backends.settings import EngineConfig, SpeculationSettings
from backends.types import GenerationResult, RequestParams

pytestmark = pytest.mark.slow  # the real model, compiled graphs

CONFIG = EngineConfig(max_seq_len=512, max_input_tokens=256, max_batch_size=8, max_iter_times=160, block_size=64,
                      prefill_chunk=64, max_prefill_batch=4, batch_buckets=(1, 2, 4, 8), cache_gb=0.25,
                      speculation=SpeculationSettings(max_draft=8))
PASSAGE = ("To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the "
           "green light stops blinking, which can take up to two minutes.")
PROMPTS = {  # a document and a line announcing its copy (a base model continues it), and free text
    "quote": f"{PASSAGE}\n\nThe same text again:\n\n",
    "notice": f"{PASSAGE}\n\nThe same notice, copied exactly:\n\n",
    "story": "Once upon a time, in a small village by the sea,",
}
GREEDY = RequestParams(max_new_tokens=96, do_sample=False, top_logprobs=1)


@pytest.fixture(scope="module")
def engine(gemma3_270m_q4_dir):
    with Engine(gemma3_270m_q4_dir, CONFIG) as eng:
        yield eng


def trace(result: GenerationResult) -> list:
    return [(t.id, t.logprob, [(a.id, a.logprob) for a in t.top]) for t in result.tokens]


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_ids_and_logprobs_equal_plain_decoding(engine, name):
    stats = engine.speculator.stats
    before = (stats.drafted, stats.accepted)
    plain = engine.submit(PROMPTS[name], replace(GREEDY, speculate=False)).result()
    assert (stats.drafted, stats.accepted) == before  # the plain request drafted nothing
    spec = engine.submit(PROMPTS[name], GREEDY).result()
    assert trace(spec) == trace(plain)
    assert spec.generated_text == plain.generated_text
    drafted, accepted = stats.drafted - before[0], stats.accepted - before[1]
    if name != "story":  # the copies: drafts were verified, and most were right
        assert drafted > 0 and accepted > drafted / 2, (drafted, accepted)
