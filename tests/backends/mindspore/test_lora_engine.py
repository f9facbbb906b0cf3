"""Multi-LoRA serving on the real default model (the ``lora_engine`` fixture: three adapters loaded, runtime
updates on): exactness against merged weights computed independently in NumPy (tests/support/lora_adapters.py
merges W + scale * B @ A; tests/support/reference_numpy.py runs the forward), row determinism when base and
adapter requests share steps, no compile after warm-up, run-time load and unload, the prefix cache keyed by
adapter. On a tiny model both kernel paths (AOT and stock ops) are checked the same way.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from backends.errors import ParameterRejected
from backends.lora import BaseDims
from backends.mindspore.families import load_model
from backends.mindspore.runners import PrefillChunk
from backends.types import RequestParams
from tests.conftest import LORA_ADAPTERS
from tests.support.lora_adapters import make_adapter, merged_weights
from tests.support.reference_numpy import RefModel

pytestmark = pytest.mark.slow

PROMPT = "My name is Olivier and I"
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return RefModel.from_dir(default_model_dir, dtype=np.float64)


def _merged(reference: RefModel, adapter_dir, dtype=np.float64) -> RefModel:
    return RefModel(reference.config, merged_weights(reference.w, adapter_dir), dtype)


def _runner_logits(engine, ids: list[int], slot: int) -> np.ndarray:
    """Last-token logits of ``ids`` through the engine's runner (the engine loop is idle: nothing submitted)."""
    runner, chunk = engine.runner, engine.runner.shapes.prefill_chunk
    blocks = engine.allocator.allocate(len(ids))
    try:
        for start in range(0, len(ids), chunk):
            logits, _ = runner.prefill([PrefillChunk(ids[start:start + chunk], start, blocks, slot)])
        return logits[0]
    finally:
        engine.allocator.release(blocks)


@pytest.mark.parametrize("name", ["all7", "rslora"])
def test_adapter_logits_equal_merged_weights(lora_engine, lora_adapter_dirs, reference, name):
    ids = lora_engine.tokenize(PROMPT)
    slot = next(a["slot"] for a in lora_engine.adapters() if a["name"] == name)
    got = _runner_logits(lora_engine, ids, slot)
    want = _merged(reference, lora_adapter_dirs[name]).next_logits(ids)
    base = reference.next_logits(ids)
    assert np.abs(want - base).max() > 0.5, "the adapter must visibly change the logits"
    assert np.abs(got - want).max() < 1e-4


def test_base_rows_are_unchanged_by_adapter_slots(lora_engine, default_engine):
    """A base request on the engine with adapters gives the same bits as on the engine without them."""
    params = RequestParams(max_new_tokens=16, do_sample=False)
    a, b = lora_engine.generate(PROMPT, params), default_engine.generate(PROMPT, params)
    assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
    assert [t.logprob for t in a.tokens] == [t.logprob for t in b.tokens]


def _reference_greedy(model: RefModel, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(model.next_logits(ids + out))))
    return out


@pytest.mark.parametrize("name", ["all7", "rslora"])
def test_adapter_greedy_ids_equal_merged_weights(lora_engine, lora_adapter_dirs, reference, name):
    ids = lora_engine.tokenize(PROMPT)
    params = RequestParams(max_new_tokens=GREEDY_TOKENS, do_sample=False, ignore_eos=True, adapter_id=name)
    got = [t.id for t in lora_engine.generate(PROMPT, params).tokens]
    want = _reference_greedy(_merged(reference, lora_adapter_dirs[name], np.float32), ids, GREEDY_TOKENS)
    assert got == want
    base = [t.id for t in lora_engine.generate(PROMPT, RequestParams(max_new_tokens=GREEDY_TOKENS,
                                                                     do_sample=False, ignore_eos=True)).tokens]
    assert got != base


MIX = [  # (adapter, sampling): base, three adapters, greedy and seeded sampling
    (None, None), ("all7", None), ("rslora", None), ("qv", None),
    (None, 7), ("all7", 8), ("rslora", 9), ("qv", 10),
]


def _params(adapter: str | None, seed: int | None) -> RequestParams:
    if seed is None:
        return RequestParams(max_new_tokens=24, do_sample=False, adapter_id=adapter, ignore_eos=True)
    return RequestParams(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=40, seed=seed,
                         adapter_id=adapter, ignore_eos=True)


def _fingerprint(result) -> list[tuple[int, float]]:
    return [(t.id, t.logprob) for t in result.tokens]


def test_mixed_adapters_in_one_batch_are_bit_identical_to_solo_runs(lora_engine):
    prompts = [f"{PROMPT} number {i}" for i in range(len(MIX))]
    solo = [_fingerprint(lora_engine.generate(p, _params(*m))) for p, m in zip(prompts, MIX)]
    compiled = set(lora_engine.runner.compiled)
    handles = [lora_engine.submit(p, _params(*m)) for p, m in zip(prompts, MIX)]
    mixed = [_fingerprint(h.result(timeout=300)) for h in handles]
    for i, (a, b) in enumerate(zip(solo, mixed)):
        assert a == b, f"request {i} ({MIX[i]}) differs when batched"
    assert len({tuple(x) for x in solo}) == len(MIX)  # the adapters and seeds all matter
    assert set(lora_engine.runner.compiled) == compiled, "a graph was compiled after warm-up"


def test_unknown_adapter_is_rejected_naming_the_loaded_ones(lora_engine):
    with pytest.raises(ParameterRejected) as err:
        lora_engine.submit(PROMPT, RequestParams(adapter_id="nope"))
    assert err.value.param == "adapter_id"
    assert str(err.value) == '"nope" is not a loaded adapter (loaded: all7, qv, rslora)'


def test_engine_without_adapters_rejects_an_adapter_id(default_engine):
    with pytest.raises(ParameterRejected, match='"all7" is not a loaded adapter \\(loaded: none'):
        default_engine.submit(PROMPT, RequestParams(adapter_id="all7"))


def test_prefix_cache_is_not_shared_across_adapters(lora_engine):
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 16)  # > two 64-token blocks
    params = RequestParams(max_new_tokens=4, do_sample=False)
    lora_engine.generate(prompt, params)
    hits = lora_engine.scheduler.hit_tokens
    with_adapter = lora_engine.generate(prompt, RequestParams(max_new_tokens=4, do_sample=False, adapter_id="qv"))
    assert lora_engine.scheduler.hit_tokens == hits  # the base model's blocks are not the adapter's K/V
    again = lora_engine.generate(prompt, RequestParams(max_new_tokens=4, do_sample=False, adapter_id="qv"))
    assert lora_engine.scheduler.hit_tokens > hits  # the adapter's own blocks are
    assert _fingerprint(again) == _fingerprint(with_adapter)


def test_runtime_load_equals_the_configured_adapter_and_unload_lets_in_flight_requests_finish(
        lora_engine, lora_adapter_dirs):
    path = lora_adapter_dirs["all7"]
    entry = lora_engine.load_adapter("runtime-all7", path)
    assert entry["rank"] == LORA_ADAPTERS["all7"]["rank"]
    static = _fingerprint(lora_engine.generate(PROMPT, _params("all7", 3)))
    assert _fingerprint(lora_engine.generate(PROMPT, _params("runtime-all7", 3))) == static

    long = RequestParams(max_new_tokens=48, do_sample=False, ignore_eos=True, adapter_id="runtime-all7")
    handle = lora_engine.submit(PROMPT, long)
    next(handle.events(timeout=120))  # its first token: it is in flight
    assert lora_engine.unload_adapter("runtime-all7") is False  # a request still runs on it
    with pytest.raises(ParameterRejected):
        lora_engine.submit(PROMPT, _params("runtime-all7", None))
    result = handle.result(timeout=120)
    assert result.generated_tokens == 48
    assert "runtime-all7" not in [a["name"] for a in lora_engine.adapters()]
    slots = {a["slot"] for a in lora_engine.adapters()}
    assert len(slots) == len(LORA_ADAPTERS)  # its slot is free again


def test_runtime_load_refuses_a_rank_over_the_slots(lora_engine, tmp_path, default_model_dir):
    dims = BaseDims.of(load_model(default_model_dir))
    make_adapter(tmp_path / "big", dims, seed=5, rank=32, alpha=32, targets=("q_proj",))
    with pytest.raises(ValueError, match="maxLoraRank"):
        lora_engine.load_adapter("big", tmp_path / "big")


# --- both kernel paths on a tiny model ---------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["aot", "stock"])
def test_tiny_model_adapter_logits_on_both_kernel_paths(tiny_model_dir, tmp_path_factory, kernels):
    from backends.mindspore.engine.lora_slots import LoraSlots
    from backends.lora import load_adapter
    from backends.mindspore.runners import build_runner
    from backends.mindspore.modeldir.weights import load_weights
    from backends.mindspore.planning.device import set_mode
    from tests.support.runner import SHAPES, prompt

    if kernels == "aot" and shutil.which("g++") is None:
        pytest.skip("the AOT kernels need g++")
    spec = load_model(tiny_model_dir)
    dims = BaseDims.of(spec)
    root = tmp_path_factory.mktemp(f"tiny_lora_{kernels}")
    make_adapter(root / "a", dims, seed=1, rank=8, alpha=16)
    make_adapter(root / "b", dims, seed=2, rank=4, alpha=8, use_rslora=True, targets=("q_proj", "v_proj"))
    set_mode(0, "CPU", 2)
    runner = build_runner(spec, load_weights(spec.checkpoint, spec.checkpoint_format), SHAPES, 24, kernels,
                          lora=(3, 8))
    slots = LoraSlots(dims, 3, 8, runner.write_lora)
    loaded = {n: slots.load(load_adapter(n, root / n, dims)) for n in ("a", "b")}
    ref = RefModel.from_dir(tiny_model_dir)
    ids = prompt(13, 5, spec.vocab_size)
    for name, slot in [(None, -1), *loaded.items()]:
        model = ref if name is None else _merged(ref, root / name)
        logits = None
        for start in range(0, len(ids), SHAPES.prefill_chunk):
            logits, _ = runner.prefill([PrefillChunk(ids[start:start + SHAPES.prefill_chunk], start, [1, 2], slot)])
        np.testing.assert_allclose(logits[0], model.next_logits(ids), atol=1e-4, rtol=0)


def test_no_graph_compiles_after_warmup_over_a_mixed_adapter_workload(lora_engine):
    """The compiled set is the warm-up plan, before and after a workload mixing the base model and every
    adapter over prompt lengths of 1 to ~150 tokens (several chunks), batch sizes coming and going, sampled
    and greedy, with prompt logprobs (the head graph)."""
    plan = set(lora_engine.runner.warmup_plan())
    assert lora_engine.runner.compiled == plan
    words = "the quick brown fox jumps over the lazy dog and runs into the woods".split()
    adapters = [None, *LORA_ADAPTERS]
    for wave in range(3):
        handles = []
        for i in range(2 + 3 * wave):
            n = 1 + (i * 37 + wave * 11) % 150
            params = RequestParams(max_new_tokens=1 + (i * 5) % 9, do_sample=i % 2 == 0, seed=i + 1,
                                   decoder_input_details=i % 3 == 0, adapter_id=adapters[(i + wave) % 4])
            handles.append(lora_engine.submit(" ".join(words[j % len(words)] for j in range(n)), params))
        for h in handles:
            assert h.result(timeout=300).generated_tokens > 0
    assert lora_engine.runner.compiled == plan, f"compiled after warm-up: {lora_engine.runner.compiled - plan}"
