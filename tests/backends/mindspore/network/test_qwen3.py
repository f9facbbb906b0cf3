"""Qwen3 (dense) against HF transformers: the tiny random checkpoint of tests/support/make_tiny_qwen3.py (q/k head
norms, head_dim 32 != hidden / heads, tied head, no attention bias) and the goldens of
tests/support/scripts/make_qwen3_goldens.py (tests/golden/qwen3_tiny.json): prompt and step logits within 1e-4
and the 20 greedy ids, on both kernel paths, alone and batched; the NumPy reference agrees with the same goldens;
without its head norms the network gives other logits (the goldens see them)."""
from __future__ import annotations

import json
from dataclasses import replace
from functools import cache

import numpy as np
import pytest

from backends.mindspore.families import load_model
from tests.support.make_tiny_qwen3 import SHAPE, make_tiny_qwen3
from tests.support.paths import GOLDEN_DIR
from tests.support.reference_numpy import RefModel

LOGIT_TOL = 1e-4
BLOCK = 16


@cache
def golden() -> dict:
    return json.loads((GOLDEN_DIR / "qwen3_tiny.json").read_text(encoding="utf-8"))


def prompts() -> dict:
    return golden()["prompts"]


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory):
    """The golden checkpoint for the host-side tests (the graph tests use conftest's tiny_qwen3_dir)."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3_host"))


def max_diff(rows, want) -> float:
    return max(float(np.abs(np.asarray(r) - np.asarray(w)).max()) for r, w in zip(rows, want))


# --- host side (no graphs) ---

def test_the_spec_reads_the_qwen3_layout(host_dir):
    spec = load_model(host_dir)
    assert spec.arch == "Qwen3ForCausalLM" and spec.qk_norm and not spec.qkv_has_bias and spec.tie_word_embeddings
    assert spec.head_dim == SHAPE["head_dim"] != spec.hidden_size // spec.num_heads
    assert (spec.num_heads, spec.num_kv_heads, spec.num_layers) == (4, 2, 3)


def test_a_llama_yaml_has_no_head_norms_and_the_key_can_say_otherwise(host_dir, tmp_path):
    yaml_text = (host_dir / "predict_tiny_qwen3.yaml").read_text()
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text((host_dir / "config.json").read_text())
    (plain / "p.yaml").write_text(yaml_text.replace("    qk_layernorm: true\n", ""))
    assert load_model(plain).qk_norm  # the architecture's default
    (plain / "p.yaml").write_text(yaml_text.replace("qk_layernorm: true", "qk_layernorm: false"))
    assert not load_model(plain).qk_norm
    (plain / "p.yaml").write_text(yaml_text.replace("Qwen3ForCausalLM", "LlamaForCausalLM")
                                  .replace("    qk_layernorm: true\n", ""))
    assert not load_model(plain).qk_norm


def test_missing_head_norm_weights_are_named(host_dir):
    from backends.mindspore.network.common import head_norm_weights
    from backends.mindspore.modeldir.weights import WeightsError, load_weights

    spec = load_model(host_dir)
    w = load_weights(spec.checkpoint, spec.checkpoint_format)
    assert head_norm_weights(spec, w, "model.layers.2.").shape == (2, SHAPE["head_dim"])
    del w["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(WeightsError, match=r"lacks \['model.layers.1.self_attn.k_norm.weight'\]"):
        head_norm_weights(spec, w, "model.layers.1.")
    assert head_norm_weights(replace(spec, qk_norm=False), w, "model.layers.1.") is None


@pytest.mark.parametrize("name", sorted(golden()["prompts"]))
def test_the_numpy_reference_equals_hf(host_dir, name):
    """The independent float64 NumPy forward (tests/support/reference_numpy.py) on the same checkpoint."""
    ref, want = RefModel.from_dir(host_dir), prompts()[name]
    full = ref.logits(want["input_ids"] + want["greedy_ids"])
    n = len(want["input_ids"])
    assert max_diff(full[want["prompt_logits"]["positions"]], want["prompt_logits"]["values"]) < LOGIT_TOL
    steps = [full[n - 1 + s] for s in want["step_logits"]["steps"]]
    assert max_diff(steps, want["step_logits"]["values"]) < LOGIT_TOL
    assert [int(i) for i in np.argmax(full[n - 1:-1], axis=-1)] == want["greedy_ids"]


def test_the_tokenizer_gives_hf_input_ids(host_dir):
    from backends.mindspore.modeldir.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(host_dir)
    for name, want in prompts().items():
        assert tok.encode(want["chat"]) == want["input_ids"], name


# --- the network in MindSpore GRAPH mode (slow: compiles graphs) ---

def make_runner(model_dir, kernels: str, spec=None):
    from backends.mindspore.planning.device import set_mode
    from backends.mindspore.runners import build_runner
    from backends.mindspore.planning.shapes import Shapes
    from backends.mindspore.modeldir.weights import load_weights

    spec = spec or load_model(model_dir)
    set_mode(0, "CPU", 2)
    shapes = Shapes(block_size=BLOCK, prefill_chunk=32, batch_buckets=(1, 4), window_buckets=(64, 256),
                    prefill_batch_buckets=(1, 2, 4))
    return build_runner(spec, load_weights(spec.checkpoint, spec.checkpoint_format), shapes, 40, kernels)


@pytest.fixture(scope="module", params=["stock", "aot"])
def runner(request, tiny_qwen3_dir):
    return make_runner(tiny_qwen3_dir, request.param)


def blocks_for(n: int, first: int) -> list[int]:
    return list(range(first, first + -(-n // BLOCK)))


def run_greedy(runner, ids: list[int], steps: int, first_block: int = 1):
    """(greedy ids, step logits [steps, V], each prompt chunk's hidden rows) prefilled in chunks, decoded alone."""
    from backends.mindspore.runners import DecodeRow, PrefillChunk

    blocks = blocks_for(len(ids) + steps, first_block)
    hidden = []
    for start in range(0, len(ids), runner.shapes.prefill_chunk):
        logits, h = runner.prefill([PrefillChunk(ids[start:start + runner.shapes.prefill_chunk], start, blocks)])
        hidden.append(h[0])
    out, rows = [], [logits[0]]
    for i in range(steps - 1):
        out.append(int(np.argmax(rows[-1])))
        rows.append(runner.decode([DecodeRow(out[-1], len(ids) + i, blocks)])[0])
    out.append(int(np.argmax(rows[-1])))
    return out, np.stack(rows), hidden


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(golden()["prompts"]))
def test_logits_and_greedy_ids_equal_hf(runner, name):
    want = prompts()[name]
    ids, steps, hidden = run_greedy(runner, want["input_ids"], golden()["new_tokens"])
    assert ids == want["greedy_ids"]
    assert max_diff(steps[want["step_logits"]["steps"]], want["step_logits"]["values"]) < LOGIT_TOL
    prompt_logits = np.concatenate([runner.prompt_logits(h) for h in hidden])
    assert max_diff(prompt_logits[want["prompt_logits"]["positions"]], want["prompt_logits"]["values"]) < LOGIT_TOL


@pytest.mark.slow
def test_batched_rows_equal_hf(runner):
    """The three golden prompts prefilled together (each call packs pieces of several prompts, at most a chunk of
    tokens in all) and decoded in one batch: each row's step logits are HF's."""
    from backends.mindspore.runners import DecodeRow, PrefillChunk

    names = sorted(prompts())
    seqs = [list(prompts()[n]["input_ids"]) for n in names]
    tables = [blocks_for(len(s) + 20, 1 + 10 * i) for i, s in enumerate(seqs)]
    done, last = [0] * len(seqs), {}
    chunk = runner.shapes.prefill_chunk
    while any(d < len(s) for d, s in zip(done, seqs)):
        pieces, budget = [], chunk
        for i, s in enumerate(seqs):
            take = min(len(s) - done[i], budget // 2 if budget == chunk else budget)  # two prompts share a call
            if take > 0:
                pieces.append((i, take))
                budget -= take
        logits, _ = runner.prefill([PrefillChunk(seqs[i][done[i]:done[i] + n], done[i], tables[i])
                                    for i, n in pieces])
        for (i, n), row in zip(pieces, logits):
            done[i] += n
            last[i] = row
    rows = [last[i] for i in range(len(seqs))]
    for step in range(golden()["new_tokens"]):
        for i, name in enumerate(names):
            want = prompts()[name]
            if step in want["step_logits"]["steps"]:
                k = want["step_logits"]["steps"].index(step)
                np.testing.assert_allclose(rows[i], want["step_logits"]["values"][k], rtol=0, atol=LOGIT_TOL)
            assert int(np.argmax(rows[i])) == want["greedy_ids"][step], (name, step)
            seqs[i].append(want["greedy_ids"][step])
        if step + 1 < golden()["new_tokens"]:
            rows = list(runner.decode([DecodeRow(s[-1], len(s) - 1, t) for s, t in zip(seqs, tables)]))


@pytest.mark.slow
def test_without_the_head_norms_the_logits_move(tiny_qwen3_dir):
    """The negative control: the same weights with the q/k head norms left out are far from HF's logits."""
    spec = replace(load_model(tiny_qwen3_dir), qk_norm=False)
    want = prompts()["capital"]
    _, steps, _ = run_greedy(make_runner(tiny_qwen3_dir, "aot", spec), want["input_ids"], 1)
    assert float(np.abs(steps[0] - np.asarray(want["step_logits"]["values"][0])).max()) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["stock", "aot"])
def test_a_network_with_adapter_slots_keeps_the_head_norms(tiny_qwen3_dir, kernels):
    """The adapter-slot layers (AotLoraDecoderLayer's five ops, the stock layer's deltas) with no adapter in use:
    HF's logits and ids."""
    from backends.mindspore.planning.device import set_mode
    from backends.mindspore.runners import build_runner
    from backends.mindspore.planning.shapes import Shapes
    from backends.mindspore.modeldir.weights import load_weights

    spec = load_model(tiny_qwen3_dir)
    set_mode(0, "CPU", 2)
    shapes = Shapes(block_size=BLOCK, prefill_chunk=32, batch_buckets=(1,), window_buckets=(64,))
    runner = build_runner(spec, load_weights(spec.checkpoint, spec.checkpoint_format), shapes, 8, kernels,
                          lora=(2, 4))
    want = prompts()["capital"]
    ids, steps, _ = run_greedy(runner, want["input_ids"], golden()["new_tokens"])
    assert ids == want["greedy_ids"]
    assert max_diff(steps[want["step_logits"]["steps"]], want["step_logits"]["values"]) < LOGIT_TOL
