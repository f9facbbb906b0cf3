"""Speculative decoding with a draft model (plugin_type draft_model) on the tiny model: the tiny model drafting
for itself (its greedy drafts are the target's greedy tokens, so every draft is accepted: the draft cache's
bookkeeping across verify steps is right) and a second tiny model of the same tokenizer and other weights
(drafts mostly refused): either way every request's ids, logprobs and logits are the plain run's, alone and in
a batch, greedy, seeded and with a grammar; no graph compiles after warm-up; the budget counts the draft model;
another tokenizer stops start-up naming the keys."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from backends.mindspore.engine.draft_model import KEY, DraftModelError, check_draft_spec
from backends.mindspore.engine.engine import Engine
from backends.mindspore.planning.memory import Available, Footprint, plan_cache
from backends.mindspore.engine.speculative import DraftCache
from backends.settings import EngineConfig, SpeculationSettings
from backends.types import GenerationResult, Grammar, RequestParams
from tests.support.tiny_model import make_tiny_model

CONFIG = EngineConfig(max_seq_len=128, max_input_tokens=100, max_batch_size=8, max_iter_times=64, block_size=16,
                      prefill_chunk=16, window_buckets=(128,), batch_buckets=(1, 2, 4, 8, 16))
DRAFTING = SpeculationSettings(max_draft=4, adaptive=False)
COUNT = "one two three four five one two three four five one"
PROMPTS = (COUNT, "the quick brown fox", COUNT * 3, "Once upon a time there was a little robot who " * 2)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A second tiny Llama: the same tokenizer (trained from the same corpus), other weights (seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_draft"), seed=1, arch="llama")


@pytest.fixture(scope="module", params=["self", "other"])
def engine(request, tiny_model_dir, other_draft_dir):
    draft = tiny_model_dir if request.param == "self" else other_draft_dir
    with Engine(tiny_model_dir, replace(CONFIG, speculation=replace(DRAFTING, draft_model=draft))) as eng:
        eng.drafter_kind = request.param
        yield eng


def run(engine: Engine, prompt: str, params: RequestParams, speculate: bool) -> GenerationResult:
    return engine.submit(prompt, replace(params, speculate=speculate)).result(timeout=300)


def trace(result: GenerationResult) -> list:
    return [(t.id, t.logprob, [(a.id, a.logprob) for a in t.top]) for t in result.tokens]


GREEDY = RequestParams(max_new_tokens=40, do_sample=False, top_logprobs=2)
SEEDED = RequestParams(max_new_tokens=40, do_sample=True, temperature=0.9, seed=3, top_logprobs=2)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_draft_model_output_is_the_plain_run(engine, params):
    stats = engine.speculator.stats
    before = stats.drafted, stats.accepted
    for prompt in PROMPTS:
        assert trace(run(engine, prompt, params, True)) == trace(run(engine, prompt, params, False))
    drafted, accepted = stats.drafted - before[0], stats.accepted - before[1]
    assert drafted > 0
    if engine.drafter_kind == "self" and not params.do_sample:
        assert accepted == drafted, "the model drafting for itself proposes exactly its greedy tokens"
    info = engine.info()["speculation"]
    assert info["method"] == "draft_model" and info["enabled"] and info["draft_forward_calls"] > 0
    assert info["draft_model"] == engine.speculator.model.name


def test_a_batch_with_a_grammar_row_and_an_opted_out_row(engine):
    regex = replace(GREEDY, grammar=Grammar("regex", "(one two three four five ){3}"), max_new_tokens=60)
    jobs = [(COUNT, GREEDY, True), (COUNT * 2, SEEDED, True), (PROMPTS[3], GREEDY, False), (COUNT, regex, True),
            (PROMPTS[1], GREEDY, True)]
    solo = [run(engine, p, q, False) for p, q, _ in jobs]
    results: list = [None] * len(jobs)

    def go(i: int) -> None:
        p, q, s = jobs[i]
        results[i] = run(engine, p, q, s)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [trace(r) for r in results] == [trace(r) for r in solo]
    assert engine.allocator.free_blocks == engine.allocator.usable_blocks


def test_no_graph_compiles_after_warmup(engine):
    model = engine.speculator.model
    plan, draft_plan = set(engine.runner.warmup_plan()), set(model.runner.warmup_plan())
    threads = [threading.Thread(target=engine.generate, args=(p, RequestParams(max_new_tokens=30 + i, do_sample=False)))
               for i, p in enumerate(PROMPTS * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert engine.runner.compiled == plan and model.runner.compiled == draft_plan


def test_the_budget_counts_the_draft_model(tiny_model_dir):
    """On a budget that binds, a draft model of the target's own size halves the cache blocks at least (each block
    holds both models' K/V) and its weights count."""
    from backends.mindspore.families import load_model

    spec = load_model(tiny_model_dir)
    alone = Footprint.of(spec, kv_dtype="float16")
    both = alone.plus(Footprint.of(spec, kv_dtype="float16"))
    assert both.bytes_per_token == 2 * alone.bytes_per_token and both.weights_bytes == 2 * alone.weights_bytes
    config = replace(CONFIG, cache_gb=64 * 16 * alone.bytes_per_token / 2**30)  # 64 blocks of the target alone
    blocks = [plan_cache(config, fp, Available(2**34, "test"), 512).num_blocks for fp in (alone, both)]
    assert 0 < blocks[1] <= blocks[0] // 2 and blocks[0] > 32


def test_a_draft_model_of_another_tokenizer_stops_start_up(tiny_model_dir, tmp_path):
    from backends.mindspore.engine.preflight import SPECULATION, PreflightError, check_model

    other = make_tiny_model(tmp_path / "other_vocab", seed=2, vocab=320)
    config = replace(CONFIG, speculation=replace(DRAFTING, draft_model=other))
    with pytest.raises(PreflightError) as caught:
        check_model(tiny_model_dir, config)
    assert caught.value.about == SPECULATION and "modelWeightPath" in caught.value.detail
    with pytest.raises(DraftModelError) as engine_error:
        Engine(tiny_model_dir, config, warmup=False)
    assert str(engine_error.value).startswith(KEY) and "modelWeightPath" in str(engine_error.value)


def test_draft_cache_keeps_what_the_sequence_still_agrees_with():
    cache = DraftCache()
    assert cache.pending([1, 2, 3]) == [1, 2, 3]  # a new sequence: its whole prompt
    cache.fed.extend([1, 2, 3, 7, 8])  # fed 1 2 3, then drafts 7 8 (the row drafted 7 8 9)
    assert cache.pending([1, 2, 3, 7, 5]) == [5] and cache.fed == [1, 2, 3, 7]  # 7 taken, 8 refused
    cache.fed.extend([5, 6])
    assert cache.pending([1, 2, 3, 7, 5, 6, 4]) == [4]  # every draft taken, plus the verify step's token
    assert cache.fed == [1, 2, 3, 7, 5, 6] and cache.sure == 7
    cache.fed.extend([4, 9, 2])  # drafts 9 2 fed; only 9 was sent (cut to fit) and the bonus token was 2
    assert cache.pending([1, 2, 3, 7, 5, 6, 4, 9, 2]) == [2]  # 2 fed again: its logits give the next draft
    assert cache.fed == [1, 2, 3, 7, 5, 6, 4, 9]


def test_drafting_needs_no_draft_model_for_prompt_lookup(tiny_model_dir):
    with Engine(tiny_model_dir, replace(CONFIG, speculation=DRAFTING), warmup=False) as eng:
        assert eng.speculator.model is None and eng.info()["speculation"]["method"] == "memory_decoding"
        assert "draft_model" not in eng.info()["speculation"]


def test_a_draft_model_must_reach_the_window_and_be_a_text_model(tmp_path):
    from types import SimpleNamespace

    short = SimpleNamespace(arch="LlamaForCausalLM", max_position_embeddings=64, model_dir=tmp_path)
    with pytest.raises(DraftModelError, match="max_position_embeddings 64 is below the served sequence length 128"):
        check_draft_spec(short, 128)
    check_draft_spec(short, 64)
    with pytest.raises(DraftModelError, match="a vision-language model cannot be a draft model"):
        check_draft_spec(SimpleNamespace(arch="Qwen2VLForConditionalGeneration", max_position_embeddings=4096,
                                         model_dir=tmp_path), 128)


def test_lora_rows_with_a_draft_model_keep_their_adapters_output(tiny_model_dir, tmp_path):
    """The draft model has no adapter: it drafts the base model's guess for an adapter row, and the verify row
    runs with the adapter, so the output is the adapter's plain run (alone and beside a base row)."""
    from backends.lora import BaseDims
    from backends.mindspore.families import load_model
    from backends.settings import LoraModuleConfig, LoraSettings
    from tests.support.lora_adapters import make_adapter

    adapter = make_adapter(tmp_path / "a", BaseDims.of(load_model(tiny_model_dir)), seed=21, strength=0.4)
    config = replace(CONFIG, speculation=replace(DRAFTING, draft_model=tiny_model_dir),
                     lora=LoraSettings(modules=(LoraModuleConfig("a", adapter),)))
    with Engine(tiny_model_dir, config) as eng:
        jobs = [(COUNT * 2, replace(GREEDY, adapter_id="a")), (COUNT, GREEDY), (COUNT, replace(SEEDED, adapter_id="a"))]
        solo = [run(eng, p, q, False) for p, q in jobs]
        assert trace(solo[0]) != trace(run(eng, COUNT * 2, GREEDY, False)), "the adapter changes the output"
        results: list = [None] * len(jobs)

        def go(i: int) -> None:
            results[i] = run(eng, *jobs[i], True)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [trace(r) for r in results] == [trace(r) for r in solo]
        assert eng.speculator.stats.drafted > 0

