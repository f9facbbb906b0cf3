"""The decoder layers as one op (``decoder_stack``, kernels/stack.cc) against one op a layer, on every family with a
tiny checkpoint and a golden: the AOT network stacks its layers (its ``stack_meta`` names the layers' kind), and the
same prompts admitted together give the same ids and the same logprobs, bit for bit, as the network of one op a layer
(``STACK_LAYERS`` False, what ``MINDSERVE_STACK_LAYERS=0`` sets). A network whose layers are of two kinds (the tiny
Qwen3-MoE's dense and expert layers) keeps one op a layer; the stack of expert layers alone is stack.cc's kind 2
(tests/backends/mindspore/kernels/test_stack_kernel.py)."""
from __future__ import annotations

import pytest

from tests.support.families import GOLDEN
from tests.support.golden_prompts import NAMES, greedy_params, load_golden

pytestmark = pytest.mark.slow  # compiles the networks


def _run(model_dir, golden, stacked: bool, monkeypatch) -> tuple[list | None, list]:
    import backends.mindspore.network.stack as stack
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    monkeypatch.setattr(stack, "STACK_LAYERS", stacked)
    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64, block_size=16,
                          prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4), kernels="aot", threads=2)
    params = greedy_params(golden, decoder_input_details=True)
    with Engine(model_dir, config) as engine:
        net = engine.runner.net
        kinds = {type(layer).stack_kind for layer in net.layers}
        meta = None if net.stack_meta is None else [*net.stack_meta.asnumpy().tolist(), *kinds]
        if stacked and len(kinds) > 1:
            meta = ("one op a layer", "mixed kinds", meta)
        handles = engine._between_steps(lambda: [engine.submit(golden["prompts"][n]["chat"], params)
                                                 for n in NAMES]).result(timeout=120)
        results = [h.result(timeout=120) for h in handles]
    return meta, [([t.id for t in r.tokens], [t.logprob for t in r.prefill[1:]], [t.logprob for t in r.tokens])
                  for r in results]


@pytest.mark.parametrize("tiny", GOLDEN, ids=str)
def test_stacked_layers_give_the_bits_of_one_op_a_layer(tiny, request, monkeypatch):
    golden = load_golden(tiny.checkpoint.golden)
    model_dir = request.getfixturevalue(tiny.checkpoint.fixture)
    meta, stacked = _run(model_dir, golden, True, monkeypatch)
    none, layered = _run(model_dir, golden, False, monkeypatch)
    assert none is None
    assert meta is not None, f"{tiny}: its layers were not stacked"
    if meta[:2] == ("one op a layer", "mixed kinds"):  # the tiny Qwen3-MoE: dense and expert layers
        assert meta[2] is None and stacked == layered
        return
    layers, group, kind, layer_kind = meta
    assert layers >= 2 and group >= 13 and kind == layer_kind
    assert stacked == layered  # ids, prompt logprobs and token logprobs: the same floats
    for name, (ids, _, _) in zip(NAMES, stacked):
        assert ids == golden["prompts"][name]["greedy_ids"]
