"""The MindSpore network against the independent NumPy reference (tests/reference_numpy.py)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from backends.mindspore.families import load_model
from backends.mindspore.planning.device import set_mode
from backends.mindspore.runners import DecodeRow, PrefillChunk
from backends.mindspore.modeldir.weights import load_weights
from tests.support.paths import REPO
from tests.support.reference_numpy import RefModel
from tests.support.runner import SHAPES, make_runner, prefill, prompt

pytestmark = pytest.mark.slow  # every test here compiles the network (its fixture picks the model indirectly)

TOL = 1e-4


@pytest.fixture(scope="module", params=[(d, k) for k in ("stock", "aot")
                                        for d in ("tiny_model_dir", "tiny_qwen2_dir", "tiny_qwen3_dir")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    model_dir = request.getfixturevalue(request.param[0])
    return make_runner(model_dir, kernels=request.param[1]), RefModel.from_dir(model_dir)


@pytest.mark.parametrize("length", [1, 5, 8, 13, 30])
def test_prefill_matches_reference(model, length):
    runner, ref = model
    ids = prompt(length, length, runner.spec.vocab_size)
    logits = prefill(runner, ids, [1, 2])
    np.testing.assert_allclose(logits, ref.logits(ids)[-1], atol=TOL, rtol=0)


def test_every_cached_decode_step_equals_full_recompute(model):
    runner, ref = model
    ids = prompt(11, 7, runner.spec.vocab_size)
    blocks = [3, 4, 5]
    logits = prefill(runner, ids, blocks)
    for _ in range(25):  # crosses the 32-token window bucket and a block boundary
        ids.append(int(np.argmax(logits)))
        logits = runner.decode([DecodeRow(ids[-1], len(ids) - 1, blocks)])[0]
        np.testing.assert_allclose(logits, ref.logits(ids)[-1], atol=TOL, rtol=0)


def test_batched_decode_rows_are_independent(model):
    runner, ref = model
    seqs = [prompt(n, 100 + n, runner.spec.vocab_size) for n in (3, 9, 17)]
    tables = [[6, 7], [8, 9], [10, 11]]
    last = [prefill(runner, ids, blocks) for ids, blocks in zip(seqs, tables)]
    for _ in range(4):
        for ids, logits in zip(seqs, last):
            ids.append(int(np.argmax(logits)))
        rows = [DecodeRow(ids[-1], len(ids) - 1, blocks) for ids, blocks in zip(seqs, tables)]
        last = list(runner.decode(rows))
        for ids, logits in zip(seqs, last):
            np.testing.assert_allclose(logits, ref.logits(ids)[-1], atol=TOL, rtol=0)


def test_prompt_logits_match_reference(model):
    runner, ref = model
    ids = prompt(6, 3, runner.spec.vocab_size)
    _, hidden = runner.prefill([PrefillChunk(ids, 0, [12])])
    np.testing.assert_allclose(runner.prompt_logits(hidden[0]), ref.logits(ids), atol=TOL, rtol=0)


def test_batched_prefill_rows_match_reference(model):
    runner, ref = model
    seqs = [prompt(n, 200 + n, runner.spec.vocab_size) for n in (3, 5)]  # packed (aot): 8 tokens = one chunk
    tables = [[13, 14], [15, 16]]
    logits, hidden = runner.prefill([PrefillChunk(ids, 0, t) for ids, t in zip(seqs, tables)])
    for ids, row, h in zip(seqs, logits, hidden):
        np.testing.assert_allclose(row, ref.logits(ids)[-1], atol=TOL, rtol=0)
        assert h.shape[0] == len(ids)


def test_aot_kernel_rows_are_bit_identical_whatever_the_batch(tiny_model_dir):
    runner = make_runner(tiny_model_dir, kernels="aot")
    ids = prompt(4, 11, runner.spec.vocab_size)  # + the 4-token other: one packed chunk of 8
    others = [prompt(n, 300 + n, runner.spec.vocab_size) for n in (4, 8, 6)]
    alone, _ = runner.prefill([PrefillChunk(ids, 0, [1, 2])])
    mixed, _ = runner.prefill([PrefillChunk(ids, 0, [3, 4])] + [PrefillChunk(o, 0, [5 + 2 * i, 6 + 2 * i])
                                                                for i, o in enumerate(others[:1])])
    assert np.array_equal(alone[0], mixed[0])
    token = int(np.argmax(alone[0]))
    solo = runner.decode([DecodeRow(token, len(ids), [1, 2])])[0]
    rows = [DecodeRow(token, len(ids), [3, 4])]
    rows += [DecodeRow(7, len(o), [5 + 2 * i, 6 + 2 * i]) for i, o in enumerate(others)]
    assert np.array_equal(solo, runner.decode(rows)[0])


@pytest.mark.parametrize("kernels", ["stock", "aot"])
def test_warmup_compiles_each_planned_shape_once(tiny_model_dir, kernels):
    runner = make_runner(tiny_model_dir, kernels=kernels)
    runner.warmup()
    plan = set(runner.warmup_plan())
    assert runner.compiled == plan
    prefill(runner, prompt(20, 1, runner.spec.vocab_size), [1, 2])
    runner.decode([DecodeRow(5, 20, [1, 2])] * 3)
    runner.decode([DecodeRow(5, 40, [3, 4, 5])])
    assert runner.compiled == plan, "a request shape fell outside the warmed-up set"
    if kernels == "stock":  # every (batch, window) bucket, prefill and decode, and the prompt-logits head
        assert len(plan) == len(SHAPES.prefill_batch_buckets + SHAPES.batch_buckets) * len(SHAPES.window_buckets) + 1
    else:  # packed graphs for the batch buckets (1, 4), the chunk (8) and chunk + largest batch (12), the head
        assert runner.shapes.prefill_sizes == (1, 4, 8, 12)
        assert len(plan) == 4 + 1


PYNATIVE_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {root!r})
from tests.support.runner import make_runner, prefill, prompt
from tests.support.reference_numpy import RefModel
runner = make_runner({path!r}, mode=1, kernels={kernels!r})
ids = prompt(9, 1, runner.spec.vocab_size)
diff = np.abs(prefill(runner, ids, [1, 2]) - RefModel.from_dir({path!r}).logits(ids)[-1]).max()
print("DIFF", diff)
"""


@pytest.mark.parametrize("kernels", ["stock", "aot"])
def test_pynative_mode_gives_the_same_logits(tiny_model_dir, kernels):
    root = str(REPO)
    script = PYNATIVE_SCRIPT.format(root=root, path=str(tiny_model_dir), kernels=kernels)
    out = subprocess.run([sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("DIFF")]
    assert line, out.stderr[-2000:]
    assert float(line[0].split()[1]) < TOL


@pytest.mark.parametrize("head_dim,heads,kv", [(1024, 8, 8), (63, 4, 4), (64, 9, 4)])
def test_aot_kernels_are_not_used_for_shapes_they_do_not_support(head_dim, heads, kv, caplog):
    from types import SimpleNamespace

    from backends.mindspore.runners import _aot_ops

    spec = SimpleNamespace(head_dim=head_dim, num_heads=heads, num_kv_heads=kv)
    assert _aot_ops(spec) is None
    assert "AOT kernels do not support" in caplog.text


def test_an_unknown_kernels_setting_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match=r"kernels must be one of auto, aot, stock, got 'fast'"):
        make_runner(tiny_model_dir, kernels="fast")


def test_the_stock_op_path_computes_in_the_yaml_compute_dtype(tiny_model_dir):
    """Targets other than CPU run the stock ops in the yaml's compute_dtype; float16 runs on CPU too, so the
    path is checked here against the float64 reference (to float16 accuracy; logits come out float32)."""
    from backends.mindspore.runners.split import SplitRunner

    spec = load_model(tiny_model_dir)
    set_mode(0, "CPU", 2)
    runner = SplitRunner(spec, load_weights(spec.checkpoint, spec.checkpoint_format), SHAPES, 24, dtype="float16")
    ids = prompt(7, 3, spec.vocab_size)
    logits, hidden = runner.prefill([PrefillChunk(ids, 0, [1])])
    ref = RefModel.from_dir(tiny_model_dir).logits(ids)
    assert logits.dtype == np.float32 and runner.prompt_logits(hidden[0]).dtype == np.float32
    np.testing.assert_allclose(logits[0], ref[-1], atol=3e-2, rtol=0)
    np.testing.assert_allclose(runner.prompt_logits(hidden[0]), ref, atol=3e-2, rtol=0)
