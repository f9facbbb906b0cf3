"""K-quants and the Q5 formats through the whole network (issue 23 item 3): a tiny Llama wide enough for
super-blocks of 256 (hidden 256, ffn 512, head_dim 64) stored as a llama-quantize Q4_K_M-like mix, served on the
AOT path, against the NumPy reference on the same blocks dequantized by the `gguf` package.

The reference quantizes each matmul's input the way the kernel does for that weight's format (qmatmul.cc,
tests/support/act_quant_ref.py): per block of 32 with dx = fp16(amax / 127) (and Q5_1's fp16 block sums) for the
32-block formats, per 256 with dx = 1 / (127 / amax) (Q8_K) for the K-quants; everything else is float64. The
tolerance is test_quantized_model.py's TOL_TINY (same reasoning: float32 rounding, far below what leaving the
activation quantization out costs, which the second test checks).
A stack whose parts ship in different formats (here q/k Q4_K beside a Q6_K v, as Q4_K_M does, and a Q4_K up beside
a Q5_K gate) is served with every part in its own format (a segmented weight, kernels.prepare_qstack): the
``mixed`` case's reference dequantizes each part as shipped and quantizes each part's input for its own format.
"""
from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors import safe_open
from safetensors.numpy import load_file

from backends.mindspore.modeldir.quant import BLOCK_SIZE, QuantWeight, cols_of
from backends.mindspore.runners import DecodeRow
from tests.support import act_quant_ref, tiny_model
from tests.support.reference_numpy import RefConfig, RefModel
from tests.support.runner import make_runner, prefill, prompt

pytestmark = pytest.mark.slow  # every test compiles the network

TOL_TINY = 5e-4
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
# Q4_K_M-like: Q4_K with Q6_K for some, a 32-block format where llama-quantize falls back (o_proj: Q5_0).
# (quantized_copy takes the first suffix that matches: the layer-specific ones come first.)
UNIFORM = {"layers.1.self_attn.o_proj.weight": "q5_1", "self_attn.o_proj.weight": "q5_0",
           "mlp.gate_proj.weight": "q5_k", "mlp.up_proj.weight": "q5_k", "mlp.down_proj.weight": "q6_k",
           "embed_tokens.weight": "q6_k"}
MIXED = {"self_attn.v_proj.weight": "q6_k", "layers.1.mlp.up_proj.weight": "q4_k", **UNIFORM}


class FormatActQuantRef(RefModel):
    """The reference with each matmul's input quantized as the kernel does for its weight's format
    (tests/support/act_quant_ref.py; ``mins``: the block mins of the Q5_1 / Q4_1 tensors)."""

    def __init__(self, config, weights, formats: dict[str, str], mins: dict[str, np.ndarray]):
        super().__init__(config, weights)
        self.block = {name.removesuffix(".weight"): BLOCK_SIZE[f] for name, f in formats.items()}
        self.block.setdefault("lm_head", self.block["model.embed_tokens"])
        self.mins = {name.removesuffix(".weight"): m for name, m in mins.items()}
        if "model.embed_tokens" in self.mins:
            self.mins.setdefault("lm_head", self.mins["model.embed_tokens"])

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = super()._linear(act_quant_ref.quant_dequant(x, self.block[name]), name)
        return y if name not in self.mins else y + act_quant_ref.mins_term(x, self.mins[name])

    def logits(self, ids: list[int]) -> np.ndarray:
        return act_quant_ref.linear(self.hidden_states(ids), self.w["lm_head.weight"], self.block["lm_head"],
                                    self.mins.get("lm_head"))

    def next_logits(self, ids: list[int]) -> np.ndarray:
        return self.logits(ids)[-1]


def _reference_weights(path) -> tuple[RefConfig, dict[str, np.ndarray], dict[str, str], dict[str, np.ndarray]]:
    """The directory's blocks dequantized by the gguf package, each tensor in the format it ships in; {name: that
    format}; {name: block mins} where it has them."""
    with safe_open(str(path / "model.safetensors"), "np") as f:
        names = json.loads(f.metadata()["mindserve.quantization"])
    raw = load_file(str(path / "model.safetensors"))
    qw = {k: QuantWeight(names[k], v.shape[0], cols_of(names[k], v.shape[1]), v) for k, v in raw.items() if k in names}
    weights = {k: (gguf_dequantize(qw[k].blocks, GGMLQuantizationType[qw[k].fmt.upper()]).reshape(qw[k].rows, -1)
                   if k in qw else v) for k, v in raw.items()}
    config = RefConfig.from_hf(json.loads((path / "config.json").read_text()))
    mins = {k: m for k, q in qw.items() if (m := act_quant_ref.block_mins(q.fmt, q.blocks)) is not None}
    return config, weights, {k: q.fmt for k, q in qw.items()}, mins


@pytest.fixture(scope="module", params=["uniform", "mixed"])
def kquant(request, tmp_path_factory):
    with mock.patch.dict(tiny_model.SHAPE, WIDE):
        src = tiny_model.make_tiny_model(tmp_path_factory.mktemp("tiny_wide"), seed=3, arch="llama")
        path = tiny_model.quantized_copy(src, tmp_path_factory.mktemp(f"tiny_k_{request.param}"), "q4_k",
                                         UNIFORM if request.param == "uniform" else MIXED)
        config, weights, formats, mins = _reference_weights(path)
        runner = make_runner(path, kernels="aot")
    return path, runner, FormatActQuantRef(config, weights, formats, mins), RefModel(config, weights)


def test_k_quant_logits_match_the_reference(kquant):
    path, runner, ref, _ = kquant
    assert runner.spec.weight_dtype == "mixed"
    assert str(runner.net.layers[0].wqkv.dtype).lower().startswith("uint8")  # served as blocks
    segmented = [layer.wqkv.shape[1] % 2 == 1 for layer in runner.net.layers]  # an odd packed length: segments
    assert segmented == ([True, True] if "mixed" in path.name else [False, False])
    assert (runner.net.layers[1].w_gate_up.shape[1] % 2 == 1) == ("mixed" in path.name)  # Q5_K gate, Q4_K up
    ids = prompt(11, 5, runner.spec.vocab_size)
    blocks = [3, 4, 5]
    logits = prefill(runner, ids, blocks)
    np.testing.assert_allclose(logits, ref.next_logits(ids), atol=TOL_TINY, rtol=0)
    for _ in range(8):
        ids.append(int(np.argmax(logits)))
        logits = runner.decode([DecodeRow(ids[-1], len(ids) - 1, blocks)])[0]
        np.testing.assert_allclose(logits, ref.next_logits(ids), atol=TOL_TINY, rtol=0)


def test_the_tolerance_is_below_what_the_activation_quantization_adds(kquant):
    _, runner, ref, plain = kquant
    ids = prompt(9, 8, runner.spec.vocab_size)
    logits = prefill(runner, ids, [6, 7])
    assert np.max(np.abs(logits - ref.next_logits(ids))) <= TOL_TINY
    assert np.max(np.abs(logits - plain.next_logits(ids))) > 4 * TOL_TINY
