"""Speculative decoding on the tiny model for the rows that need more than prompt lookup: grammar rows draft
(each draft cut at the first token its grammar refuses, each verified position masked by the grammar after the
accepted tokens), LoRA rows draft and verify with their own adapter in a mixed batch, and greedy output with
speculation on is the plain run's on every kernel variant this machine runs (ids and the raw logits of every
position: the kernels' row determinism on each ISA)."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest

from backends.mindspore.engine.engine import Engine
from backends.mindspore.engine.speculative import Speculator
from backends.settings import EngineConfig, LoraModuleConfig, LoraSettings, SpeculationSettings
from backends.types import GenerationResult, Grammar, RequestParams
from tests.support.kernel_variants import HOST_VARIANTS, skip_unless_runs

CONFIG = EngineConfig(max_seq_len=128, max_input_tokens=100, max_batch_size=8, max_iter_times=64, block_size=16,
                      prefill_chunk=16, window_buckets=(128,), batch_buckets=(1, 2, 4, 8, 16),
                      speculation=SpeculationSettings(max_draft=4, ngram_min=1, ngram_max=2, adaptive=False))
COUNT = "one two three four five one two three four five one"
RECORD = '{"name":"the cat","city":"Paris","year":2024}'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "city": {"type": "string", "maxLength": 8}, "year": {"type": "integer"}},
          "required": ["name", "city", "year"], "additionalProperties": False}
GRAMMARS = {  # (prompt, grammar): the answer can copy the prompt, so drafts are accepted
    "json": (f"copy: {RECORD} {RECORD}", Grammar("json", json.dumps(SCHEMA))),
    "regex": (COUNT, Grammar("regex", "(one two three four five ){3}")),
    "regex-refusing": (COUNT, Grammar("regex", "(one two four )+five")),  # the prompt's continuation is refused
}
ADAPTERS = {"a": 21, "b": 22}  # name -> seed (strength 0.4: the greedy text changes, and still repeats itself)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    from backends.lora import BaseDims
    from backends.mindspore.families import load_model
    from tests.support.lora_adapters import make_adapter

    root, dims = tmp_path_factory.mktemp("tiny_lora"), BaseDims.of(load_model(tiny_model_dir))
    return {name: make_adapter(root / name, dims, seed=seed, strength=0.4) for name, seed in ADAPTERS.items()}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapter_dirs):
    lora = LoraSettings(modules=tuple(LoraModuleConfig(n, p) for n, p in adapter_dirs.items()))
    with Engine(tiny_model_dir, replace(CONFIG, lora=lora)) as eng:
        yield eng


def run(engine: Engine, prompt: str, params: RequestParams, speculate: bool) -> tuple[GenerationResult, str]:
    handle = engine.submit(prompt, replace(params, speculate=speculate))
    return handle.result(timeout=300), handle.request_id


def trace(result: GenerationResult) -> list:
    return [(t.id, t.logprob, [(a.id, a.logprob) for a in t.top]) for t in result.tokens]


def same_bits(engine, prompt, params, logits_log) -> tuple[GenerationResult, int]:
    """Run ``prompt`` with speculation off then on; assert the same tokens, logprobs and logits at every
    position; the result and the drafts accepted on the speculative run."""
    off, off_id = run(engine, prompt, params, speculate=False)
    before = engine.speculator.stats.accepted
    on, on_id = run(engine, prompt, params, speculate=True)
    assert trace(on) == trace(off) and on.generated_text == off.generated_text
    assert len(logits_log[on_id]) == len(logits_log[off_id]) == on.generated_tokens
    for i, (a, b) in enumerate(zip(logits_log[on_id], logits_log[off_id])):
        assert np.array_equal(a, b), f"position {i}: the verified logits differ from one-at-a-time decoding"
    return on, engine.speculator.stats.accepted - before


@pytest.fixture
def grammar_drafts(monkeypatch):
    """Every draft a grammar row was sent with, checked against its grammar as it was proposed: [(seq, drafts,
    tokens the grammar takes)]."""
    seen = []
    plain = Speculator.propose

    def propose(self, seqs, budget, fit=lambda wanted: wanted):
        out = plain(self, seqs, budget, fit)
        seen.extend((s, d, s.grammar.matcher.validate_tokens(list(d)))
                    for s, d in out.items() if s.grammar is not None)
        return out

    monkeypatch.setattr(Speculator, "propose", propose)
    return seen


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_grammar_rows_draft_and_keep_the_plain_runs_bits(engine, logits_log, grammar_drafts, name):
    prompt, grammar = GRAMMARS[name]
    params = RequestParams(max_new_tokens=60, do_sample=False, top_logprobs=2, grammar=grammar)
    on, accepted = same_bits(engine, prompt, params, logits_log)
    assert all(taken == len(d) for _, d, taken in grammar_drafts), "a draft the grammar refuses was sent"
    if name == "json":
        assert on.generated_text.startswith('{"name":"') and '","city":"' in on.generated_text
    if name == "regex":
        assert on.generated_text == "one two three four five " * 3 and accepted >= 5
    if name == "regex-refusing":  # what follows "one" in the prompt is "two three": "three" is refused
        assert on.generated_text.startswith("one two four one two four")
    assert grammar_drafts and accepted > 0, "grammar rows drafted and had drafts accepted"


def test_sampled_grammar_rows_keep_their_seeded_text(engine):
    prompt, grammar = GRAMMARS["json"]
    params = RequestParams(max_new_tokens=40, do_sample=True, temperature=0.8, seed=5, grammar=grammar)
    assert trace(run(engine, prompt, params, True)[0]) == trace(run(engine, prompt, params, False)[0])


def test_lora_rows_draft_with_their_own_adapter_in_a_mixed_batch(engine):
    """Base and adapter rows, speculating and plain, greedy and seeded, at once: each equals its solo plain
    run; the adapters change the text (their verify rows ran with them) and their drafts were accepted."""
    greedy = RequestParams(max_new_tokens=30, do_sample=False, top_logprobs=2)
    seeded = RequestParams(max_new_tokens=30, do_sample=True, temperature=0.8, seed=7)
    jobs = [(COUNT * 2, greedy, None, True), (COUNT * 2, greedy, "a", True), (COUNT * 2, greedy, "b", True),
            (COUNT * 2, seeded, "a", True), (COUNT * 2, greedy, "a", False), (COUNT, greedy, "b", True)]
    solo = [run(engine, p, replace(q, adapter_id=a), speculate=False)[0] for p, q, a, _ in jobs]
    assert len({tuple(t.id for t in r.tokens) for r in solo[:3]}) == 3, "each adapter changes the greedy text"
    for adapter in ("a", "b"):
        before = engine.speculator.stats.accepted
        run(engine, COUNT * 2, replace(greedy, adapter_id=adapter), speculate=True)
        assert engine.speculator.stats.accepted > before, f"adapter {adapter}'s rows had drafts accepted"
    results: list = [None] * len(jobs)

    def go(i: int) -> None:
        p, q, a, s = jobs[i]
        results[i] = run(engine, p, replace(q, adapter_id=a), speculate=s)[0]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [trace(r) for r in results] == [trace(r) for r in solo]


@pytest.mark.parametrize("variant", HOST_VARIANTS)
def test_greedy_speculation_is_the_plain_run_on_every_kernel_variant(tiny_model_dir, logits_log, variant):
    skip_unless_runs(variant)
    with Engine(tiny_model_dir, replace(CONFIG, kernel_isa=variant)) as eng:
        assert eng.runner.kernel_variant["variant"] == variant and eng.speculator.active
        params = RequestParams(max_new_tokens=40, do_sample=False, top_logprobs=2)
        _, accepted = same_bits(eng, COUNT * 2, params, logits_log)
        _, grammar_accepted = same_bits(eng, GRAMMARS["regex"][0], replace(params, grammar=GRAMMARS["regex"][1]),
                                        logits_log)
        assert accepted > 0 and grammar_accepted > 0
