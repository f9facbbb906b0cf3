"""Speculative decoding on the real default model: with drafts verified in the packed step, every request's ids,
logprobs, alternatives and the raw logits of every position are the bits of plain decoding (the same engine,
``speculate=False``), alone, batched with others, sampled with a seed, constrained by a JSON Schema or a regex,
cut by stop strings and max_new_tokens, on cached prefixes; and no graph compiles after warm-up."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest

from backends.mindspore.engine.engine import Engine
from backends.settings import EngineConfig, SpeculationSettings
from backends.types import GenerationResult, Grammar, RequestParams, TokenEvent
from tests.support.golden import EOS_PROMPT, NUMPY_GOLDEN, PROMPT

CONFIG = EngineConfig(max_seq_len=512, max_input_tokens=400, max_batch_size=8, max_iter_times=128, block_size=64,
                      prefill_chunk=64, max_prefill_batch=4, batch_buckets=(1, 4, 8), cache_gb=0.5,
                      speculation=SpeculationSettings(max_draft=6, ngram_min=1, ngram_max=3))
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil, "
           "a clean rag and a small brass key that opened the lamp room.")
QUOTE = (f"<|im_start|>user\nRepeat the following passage exactly, word for word.\n\n{PASSAGE}<|im_end|>\n"
         "<|im_start|>assistant\n")  # the answer copies the passage
COUNT = "one two three four five six seven eight nine ten, one two three four five six seven eight nine ten, one two"


@pytest.fixture(scope="module")
def engine(default_model_dir):
    with Engine(default_model_dir, CONFIG) as eng:
        yield eng


def trace(result: GenerationResult) -> list:
    """Every generated token with its exact logprob and alternatives: any numerical difference shows."""
    return [(t.id, t.text, t.logprob, [(a.id, a.logprob) for a in t.top]) for t in result.tokens]


def run(engine, prompt: str, params: RequestParams, speculate: bool):
    """(result, request id, token events) of one request, with speculation on or off for it."""
    handle = engine.submit(prompt, replace(params, speculate=speculate))
    *events, result = handle.events(timeout=300)
    assert all(isinstance(e, TokenEvent) for e in events)
    return result, handle.request_id, events


def accepted(engine) -> int:
    return engine.speculator.stats.accepted


RECORD = '{"name":"Ada Lovelace","born":1815,"city":"London","known_for":"the first published computer program"}'
SCHEMA = json.dumps({"type": "object", "required": ["name", "born", "city", "known_for"], "additionalProperties": False,
                     "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"},
                                    "known_for": {"type": "string"}}})
REFORMAT = (f"<|im_start|>user\nReturn this record as JSON, unchanged: {RECORD}<|im_end|>\n"
            "<|im_start|>assistant\n")  # the grammar's compact JSON copies it
GREEDY = RequestParams(max_new_tokens=60, do_sample=False, top_logprobs=3)
CASES = {
    "golden": (PROMPT, RequestParams(max_new_tokens=20, do_sample=False, top_logprobs=2)),
    "eos": (EOS_PROMPT, GREEDY),
    "quote": (QUOTE, GREEDY),
    "count": (COUNT, GREEDY),
    "sampled": (COUNT, RequestParams(max_new_tokens=60, do_sample=True, temperature=0.8, top_p=0.95, seed=99,
                                     top_logprobs=2)),
    "json": (REFORMAT, replace(GREEDY, grammar=Grammar("json", SCHEMA))),  # a grammar row drafts, masked each step
    "regex": (REFORMAT, replace(GREEDY, grammar=Grammar("regex", r"Ada Lovelace was born in 18\d\d in [A-Z][a-z]+\."))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_speculation_gives_the_plain_runs_bits(engine, logits_log, name):
    assert engine.runner.kernels == "aot" and engine.speculator.active
    prompt, params = CASES[name]
    off, off_id, off_events = run(engine, prompt, params, speculate=False)
    before = accepted(engine)
    on, on_id, on_events = run(engine, prompt, params, speculate=True)
    assert trace(on) == trace(off) and on.generated_text == off.generated_text
    assert on.finish_reason == off.finish_reason
    assert len(logits_log[on_id]) == len(logits_log[off_id]) == on.generated_tokens
    for i, (a, b) in enumerate(zip(logits_log[on_id], logits_log[off_id])):
        assert np.array_equal(a, b), f"position {i}: the verified logits differ from one-at-a-time decoding"
    # one event per token, in order, each with its own text
    assert [e.token.id for e in on_events] == [t.id for t in on.tokens] == [e.token.id for e in off_events]
    assert [e.index for e in on_events] == list(range(on.generated_tokens))
    if name == "golden":
        assert [t.id for t in on.tokens] == NUMPY_GOLDEN["generated_ids"]
    if name in ("quote", "count", "json"):
        assert accepted(engine) - before >= 10, "drafts were accepted: the verify path ran"
    if name == "json":
        assert json.loads(on.generated_text)["city"] == "London"


def test_stop_string_and_max_new_tokens_cut_inside_an_accepted_run(engine):
    off, _, _ = run(engine, COUNT, RequestParams(max_new_tokens=60, do_sample=False), speculate=False)
    words = off.generated_text.split()
    assert len(words) > 8
    stop = " ".join(words[5:7])
    for params in (RequestParams(max_new_tokens=60, do_sample=False, stop=(stop,)),
                   RequestParams(max_new_tokens=9, do_sample=False), RequestParams(max_new_tokens=2, do_sample=False)):
        want, _, _ = run(engine, COUNT, params, speculate=False)
        got, _, events = run(engine, COUNT, params, speculate=True)
        assert (got.generated_text, got.finish_reason, trace(got)) == (want.generated_text, want.finish_reason,
                                                                       trace(want))
        assert sum(e.last for e in events) == 1 and events[-1].last
    assert off.generated_text.find(stop) > 0


def test_a_mixed_batch_of_speculating_and_plain_rows_equals_each_solo_run(engine):
    """Eight requests at once (greedy and seeded, drafting and opted out, prompts still prefilling while others
    verify), each equal to its plain solo run; then the same again with their prompts cached."""
    jobs = [(QUOTE, GREEDY, True), (COUNT, GREEDY, False), (COUNT, CASES["sampled"][1], True),
            (PROMPT, GREEDY, True), (PASSAGE * 3, GREEDY, True), (QUOTE, CASES["sampled"][1], False),
            (COUNT[::-1], GREEDY, True), (PASSAGE, RequestParams(max_new_tokens=30, do_sample=False), True)]
    solo = [run(engine, p, q, speculate=False)[0] for p, q, _ in jobs]
    for _ in range(2):  # the second round finds the prompts in the prefix cache
        results: list = [None] * len(jobs)

        def go(i: int) -> None:
            p, q, s = jobs[i]
            results[i] = run(engine, p, q, speculate=s)[0]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [trace(r) for r in results] == [trace(r) for r in solo]
    assert engine.scheduler.hit_tokens > 0
    assert engine.allocator.free_blocks == engine.allocator.usable_blocks  # every block came back


def test_no_graph_compiles_after_warmup_with_drafts(engine):
    """Drafts add logit rows and tokens to the packed steps, within the warmed-up sizes: the compiled set is
    still the warm-up plan after verify steps of every width, alone and beside prompt chunks."""
    plan = set(engine.runner.warmup_plan())
    threads = [threading.Thread(target=engine.generate, args=(p, RequestParams(max_new_tokens=40 + i, do_sample=False)))
               for i, p in enumerate([QUOTE, COUNT, PASSAGE * 4, QUOTE * 2, COUNT * 3, PASSAGE])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert engine.speculator.stats.verify_steps > 0
    assert engine.runner.compiled == plan, f"compiled after warm-up: {engine.runner.compiled - plan}"


def test_info_reports_the_counts(engine):
    info = engine.info()["speculation"]
    assert info["enabled"] and info["method"] == "memory_decoding" and info["max_draft"] == 6
    assert info["accepted_tokens"] <= info["drafted_tokens"] and info["tokens_per_verify_step"] >= 1
