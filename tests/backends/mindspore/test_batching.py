"""Continuous batching on the real default model: reproducibility under batching, no compile after warm-up."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from backends.mindspore.engine.engine import Engine
from backends.settings import EngineConfig
from backends.types import GenerationResult, RequestParams

# Batches of 1..8 with packed prompt chunks of up to 4 prompts: every path of the scheduler.
CONFIG = EngineConfig(max_seq_len=512, max_input_tokens=400, max_batch_size=8, max_iter_times=128, block_size=64,
                      prefill_chunk=64, max_prefill_batch=4, batch_buckets=(1, 4, 8))
WORDS = ("the river ran past old stone walls while children counted boats and the baker sang about bread, "
         "rain, a lost key, seven lanterns and the long road north").split()


def text(n_words: int, shift: int = 0) -> str:
    return " ".join(WORDS[(i + shift) % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def engine(default_model_dir):
    with Engine(default_model_dir, CONFIG) as eng:
        eng.eos_ids = frozenset()  # every request runs to max_new_tokens: the batch stays mixed for longer
        yield eng


def trace(result: GenerationResult) -> list[tuple[int, float | None]]:
    """Prompt and generated token ids with their exact float logprobs: any numerical difference shows."""
    return [(t.id, t.logprob) for t in result.prefill + result.tokens]


TARGETS = {
    "greedy": (text(19), RequestParams(max_new_tokens=40, do_sample=False, decoder_input_details=True)),
    "sampled": (text(26, 5), RequestParams(max_new_tokens=40, do_sample=True, temperature=0.9, top_p=0.95,
                                           top_k=50, seed=1234, decoder_input_details=True)),
}
# Seven companions: other lengths, greedy and sampled, leaving at different steps.
COMPANIONS = [(text(3 + 11 * i, i), RequestParams(max_new_tokens=12 + 7 * i, do_sample=i % 2 == 1, temperature=0.7,
                                                  seed=77 + i)) for i in range(7)]


@pytest.mark.parametrize("name", list(TARGETS))
def test_seeded_request_is_bit_identical_alone_and_among_seven_others(engine, name):
    assert engine.runner.kernels == "aot", "the row-deterministic AOT kernels must be in use"
    prompt, params = TARGETS[name]
    alone = engine.generate(prompt, params)
    assert alone.generated_tokens == 40 and len(alone.prefill) == alone.prompt_tokens
    # The target goes in fourth, so it is prefilled packed beside other prompts and decodes in batches
    # of 8, then fewer as the companions finish.
    handles = [engine.submit(p, q) for p, q in COMPANIONS[:3]]
    target = engine.submit(prompt, params)
    handles += [engine.submit(p, q) for p, q in COMPANIONS[3:]]
    mixed = target.result(timeout=300)
    others = [h.result(timeout=300) for h in handles]
    assert trace(mixed) == trace(alone)
    assert mixed.generated_text == alone.generated_text
    assert all(r.generated_tokens == q.max_new_tokens for r, (_, q) in zip(others, COMPANIONS))


def test_companions_are_themselves_unchanged_by_batching(engine):
    """Not only the target: every request of the mixed batch equals its solo run."""
    solo = [engine.generate(p, q) for p, q in COMPANIONS[:4]]
    handles = [engine.submit(p, q) for p, q in COMPANIONS[:4]]
    assert [trace(h.result(timeout=300)) for h in handles] == [trace(r) for r in solo]


def test_no_graph_compiles_after_warmup_over_a_mixed_workload(engine):
    """Many prompt lengths (1 to ~350 tokens: one to six packed chunks), batch sizes 1 to 8 coming
    and going, sampled and greedy, prompt logprobs: the compiled set is the warm-up plan, unchanged."""
    plan = set(engine.runner.warmup_plan())
    assert engine.runner.compiled == plan
    lengths = [1, 2, 5, 17, 40, 63, 64, 65, 100, 129, 200, 250]
    results: list[GenerationResult] = []
    lock = threading.Lock()

    def run(i: int, n: int) -> None:
        params = RequestParams(max_new_tokens=1 + (i * 5) % 23, do_sample=i % 3 == 0, seed=i + 1,
                               decoder_input_details=i % 4 == 0)
        result = engine.generate(text(n, i), params)
        with lock:
            results.append(result)

    for wave in (lengths[:3], lengths[3:9], lengths, lengths[9:]):  # 3, 6, 12 then 3 at once
        threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(wave)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert len(results) == 3 + 6 + 12 + 3
    assert max(r.prompt_tokens for r in results) > 3 * CONFIG.prefill_chunk  # long prompts took several chunks
    assert engine.runner.compiled == plan, f"compiled after warm-up: {engine.runner.compiled - plan}"
    # packed steps of 1, 4, 8 (the decode buckets), 16, 32, 48 (every 16), 64 (the chunk) and 72 (chunk + batch)
    # tokens, and the prompt-logits head
    assert engine.runner.shapes.prefill_sizes == (1, 4, 8, 16, 32, 48, 64, 72)
    assert len(plan) == 8 + 1


# --- every KV cache format (kvCacheDtype): the engine above runs float32 (the Python API's default) -----------

@pytest.fixture(scope="module", params=["float16", "bfloat16", "q8_0"])
def kv_engine(default_model_dir, request):
    with Engine(default_model_dir, replace(CONFIG, kv_cache_dtype=request.param)) as eng:
        eng.eos_ids = frozenset()
        yield eng


def test_each_kv_cache_dtype_keeps_a_row_bit_identical_alone_and_batched(kv_engine):
    """The cache's format changes the numbers, never their dependence on the batch: a row reads only its own
    keys, encoded the same way whoever else is in the step."""
    assert kv_engine.runner.kv_dtype == kv_engine.config.kv_cache_dtype
    for prompt, params in TARGETS.values():
        alone = kv_engine.generate(prompt, params)
        handles = [kv_engine.submit(p, q) for p, q in COMPANIONS[:3]]
        target = kv_engine.submit(prompt, params)
        handles += [kv_engine.submit(p, q) for p, q in COMPANIONS[3:5]]
        assert trace(target.result(timeout=300)) == trace(alone)
        for h in handles:
            h.result(timeout=300)
