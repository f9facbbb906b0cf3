"""The engine's Python API on the tiny model: generation, sampling determinism, stopping, cancellation."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from backends.errors import InputRejected
from backends.mindspore.modeldir.yaml_tree import ConfigError
from backends.mindspore.engine.engine import Engine
from backends.settings import EngineConfig
from backends.types import FinishReason, GenerationResult, RequestParams, TokenEvent
from tests.support.reference_numpy import RefModel

TINY = EngineConfig(max_seq_len=128, max_input_tokens=100, max_batch_size=4, max_iter_times=64,
                    block_size=16, prefill_chunk=16, window_buckets=(32, 128), batch_buckets=(1, 4))
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    with Engine(tiny_model_dir, TINY) as engine:
        yield engine


def test_greedy_equals_reference(tiny_engine, tiny_model_dir):
    ids = tiny_engine.tokenizer.encode(PROMPT)
    result = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=24, do_sample=False))
    got = [t.id for t in result.tokens]
    want = RefModel.from_dir(tiny_model_dir).greedy(ids, len(got))
    assert got == want
    assert result.prompt_tokens == len(ids)
    assert result.finish_reason in (FinishReason.LENGTH, FinishReason.EOS_TOKEN)


def test_events_then_result(tiny_engine):
    handle = tiny_engine.submit(PROMPT, RequestParams(max_new_tokens=7))
    events = list(handle.events(timeout=60))
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    result = events[-1]
    assert isinstance(result, GenerationResult)
    assert [e.index for e in events[:-1]] == list(range(result.generated_tokens))
    assert "".join(e.token.text for e in events[:-1] if not e.token.special) == result.generated_text


def test_seeded_sampling_is_reproducible(tiny_engine):
    params = RequestParams(max_new_tokens=16, temperature=1.5, seed=42)
    first = tiny_engine.generate(PROMPT, params)
    again = tiny_engine.generate(PROMPT, params)
    other = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=16, temperature=1.5, seed=43))
    assert [t.id for t in first.tokens] == [t.id for t in again.tokens]
    assert [t.id for t in first.tokens] != [t.id for t in other.tokens]
    assert first.seed == 42


def test_top_k_1_equals_greedy(tiny_engine):
    greedy = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=12, do_sample=False))
    top1 = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=12, top_k=1, seed=5))
    assert [t.id for t in top1.tokens] == [t.id for t in greedy.tokens]


def test_concurrent_requests_match_solo_runs(tiny_engine):
    prompts = [PROMPT, "hello world", "a b c d e f g", PROMPT + " again and again"]
    params = [RequestParams(max_new_tokens=10 + i, temperature=0.8, seed=100 + i) for i in range(4)]
    solo = [tiny_engine.generate(p, q) for p, q in zip(prompts, params)]
    handles = [tiny_engine.submit(p, q) for p, q in zip(prompts, params)]
    together = [h.result(timeout=120) for h in handles]
    assert [[t.id for t in r.tokens] for r in together] == [[t.id for t in r.tokens] for r in solo]


def test_stop_string_is_cut(tiny_engine):
    free = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=20, do_sample=False))
    text = free.generated_text
    stop = text[3:6]
    assert stop.strip(), f"generated text too short to pick a stop string: {text!r}"
    stopped = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=20, do_sample=False, stop=(stop,)))
    assert stopped.finish_reason == FinishReason.STOP_SEQUENCE
    assert stopped.generated_text == text[: text.index(stop)]


def test_max_new_tokens_capped_by_iter_times(tiny_engine):
    result = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=1000, do_sample=False))
    assert result.generated_tokens <= TINY.max_iter_times
    if result.finish_reason == FinishReason.LENGTH:
        assert result.generated_tokens == TINY.max_iter_times


def test_truncate_keeps_last_tokens(tiny_engine):
    ids = tiny_engine.tokenizer.encode(PROMPT)
    result = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=2, truncate=3, decoder_input_details=True))
    assert result.prompt_tokens == 3
    assert [t.id for t in result.prefill] == ids[-3:]


def test_prefill_logprobs_match_reference(tiny_engine, tiny_model_dir):
    ids = tiny_engine.tokenizer.encode(PROMPT)
    result = tiny_engine.generate(PROMPT, RequestParams(max_new_tokens=1, decoder_input_details=True))
    logits = RefModel.from_dir(tiny_model_dir).logits(ids)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    assert result.prefill[0].logprob is None
    want = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    np.testing.assert_allclose([t.logprob for t in result.prefill[1:]], want, atol=1e-3)


def test_too_long_prompt_is_rejected_with_counts(tiny_engine):
    with pytest.raises(InputRejected, match=r"has \d+ tokens, more than the limit of 100"):
        tiny_engine.submit("word " * 400, RequestParams())


def test_cancel_frees_the_cache(tiny_engine):
    free_before = tiny_engine.allocator.free_blocks
    got_first = threading.Event()
    handle = tiny_engine.submit(PROMPT, RequestParams(max_new_tokens=60, do_sample=False),
                                listener=lambda e: got_first.set())
    assert got_first.wait(60)
    handle.cancel()
    assert handle.done.wait(10)
    assert tiny_engine.allocator.free_blocks == free_before
    assert tiny_engine.info()["running"] == 0


def test_a_failing_request_does_not_take_down_the_others(tiny_engine, monkeypatch):
    """Fault isolation: a forward that fails for one row fails that request only (424 upstream)."""
    from backends.errors import GenerationFailed

    real_decode, real_prefill = tiny_engine.runner.decode, tiny_engine.runner.prefill
    bad: list = []

    def flaky(real):
        def forward(rows):  # runs on the engine thread, so reading the scheduler is safe
            bad_blocks = [seq.blocks for seq in tiny_engine.scheduler.all() if seq.handle in bad]
            if any(row.blocks in bad_blocks for row in rows):
                raise RuntimeError("injected fault")
            return real(rows)
        return forward

    # every forward holding a row of the bad request fails: alone, or batched with the good ones
    # (decode rows also reach the runner's prefill, packed with prompt chunks, with the AOT kernels)
    monkeypatch.setattr(tiny_engine.runner, "decode", flaky(real_decode))
    monkeypatch.setattr(tiny_engine.runner, "prefill", flaky(real_prefill))
    good = [tiny_engine.submit(PROMPT, RequestParams(max_new_tokens=8, do_sample=False)) for _ in range(2)]
    bad.append(tiny_engine.submit("poison " + PROMPT, RequestParams(max_new_tokens=8, do_sample=False)))
    with pytest.raises(GenerationFailed, match="injected fault"):
        bad[0].result(timeout=60)
    for handle in good:
        assert handle.result(timeout=60).generated_tokens == 8
    assert tiny_engine.allocator.free_blocks == tiny_engine.allocator.usable_blocks


@pytest.fixture(scope="module")
def tiny_engine_ms(tiny_model_dir):
    """The stock-op path (no AOT kernels): separate prefill and decode calls, prompts-first scheduling."""
    from dataclasses import replace

    with Engine(tiny_model_dir, replace(TINY, kernels="stock", max_prefill_batch=2)) as engine:
        assert engine.runner.kernels == "stock"
        yield engine


def test_stock_op_engine_greedy_equals_reference(tiny_engine_ms, tiny_model_dir):
    ids = tiny_engine_ms.tokenizer.encode(PROMPT)
    result = tiny_engine_ms.generate(PROMPT, RequestParams(max_new_tokens=24, do_sample=False))
    assert [t.id for t in result.tokens] == RefModel.from_dir(tiny_model_dir).greedy(ids, result.generated_tokens)


def test_stock_op_engine_serves_concurrent_requests_with_the_reference_tokens(tiny_engine_ms, tiny_model_dir):
    """Prompts of several chunks, batched prefill and decode, prompts-first steps: each greedy request
    still gets exactly the reference model's tokens (the stock ops are not bit-identical across batch
    sizes, so this compares token ids of greedy runs, which a 1e-5 difference does not flip here)."""
    ref = RefModel.from_dir(tiny_model_dir)
    prompts = [PROMPT, "hello world", PROMPT * 3, "a b c d e f g"]
    handles = [tiny_engine_ms.submit(p, RequestParams(max_new_tokens=10, do_sample=False)) for p in prompts]
    for prompt, handle in zip(prompts, handles):
        result = handle.result(timeout=120)
        assert [t.id for t in result.tokens] == ref.greedy(tiny_engine_ms.tokenizer.encode(prompt), 10)


def test_info_reports_the_device_and_the_kernel_path_in_use(tiny_engine, tiny_engine_ms):
    assert {k: tiny_engine.info()[k] for k in ("device", "kernels", "compute_dtype")} == \
        {"device": "CPU", "kernels": tiny_engine.runner.kernels, "compute_dtype": "float32"}
    assert tiny_engine_ms.info()["kernels"] == "stock"
    assert tiny_engine_ms.info()["kv_cache_dtype"] == "float32"  # the stock-op path's cache is its compute dtype


def ascend_copy(model_dir: Path, to: Path) -> Path:
    """The model directory with its yaml saying ``device_target: Ascend``."""
    model = Path(shutil.copytree(model_dir, to))
    yaml_path = model / "predict_tiny.yaml"
    yaml_path.write_text(yaml_path.read_text(encoding="utf-8").replace("device_target: CPU", "device_target: Ascend"),
                         encoding="utf-8")
    return model


def test_a_device_target_without_its_runtime_fails_with_one_line_naming_the_yaml_key(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    """No silent fallback to CPU: the yaml's device_target is what MindSpore runs on, or start-up stops."""
    import backends.mindspore.engine.engine_parts as engine_module  # where the engine's parts are loaded

    model = ascend_copy(tiny_model_dir, tmp_path / "model")
    monkeypatch.setattr(engine_module, "load_weights", lambda *a: pytest.fail("weights loaded before the device check"))
    with pytest.raises(ConfigError) as caught:
        Engine(model, TINY)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{model / 'predict_tiny.yaml'}: context.device_target: Ascend, but this MindSpore ")
    assert message.endswith("has no Ascend runtime (found: CPU)")
