"""convert-gguf for ``qwen3moe``: the tiny Qwen3-MoE checkpoint written as a float32 GGUF the way llama.cpp lays it
out (tests/support/hf_to_gguf.py: the router as ``ffn_gate_inp``, each layer's experts stacked into the 3-D
``ffn_{gate,up,down}_exps``, ``qwen3moe.expert_*`` metadata) converts back to the HF tensors bit for bit, with a spec
the loader reads as the source's (a block without a router is a dense ``mlp_only`` layer); a q8_0 conversion stores
every expert as Q8_0 blocks and keeps the routers float32; the converted model generates as its source (HF's golden
greedy ids), and its Q8_0 experts run on the AOT kernels close to their dequantized values on the stock ops."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from backends.mindspore.families import load_model
from backends.mindspore.sources.gguf_convert import convert_gguf
from tests.support import act_quant_ref
from tests.support.hf_to_gguf import write_gguf
from tests.support.make_tiny_qwen3_moe import make_tiny_qwen3_moe
from tests.support.paths import GOLDEN_DIR
from tests.support.reference_numpy import RefConfig, RefModel, silu

FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
          "rms_norm_eps", "rope_theta", "qkv_has_bias", "tie_word_embeddings", "qk_norm", "eos_token_ids", "moe",
          "arch")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The golden checkpoint itself (layer 1 dense)."""
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe_src"))


@pytest.fixture(scope="module")
def gguf_path(source, tmp_path_factory) -> Path:
    return write_gguf(source, tmp_path_factory.mktemp("moe_gguf") / "qwen3moe.gguf", "qwen3moe")


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory) -> Path:
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("moe_out") / "m", progress=False)


def test_tensors_come_back_as_the_hf_source(source, converted):
    want = load_file(str(source / "model.safetensors"))
    got = load_file(str(converted / "model.safetensors"))
    assert set(got) == set(want)
    for name, tensor in want.items():
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in got and "model.layers.1.mlp.gate_proj.weight" in got


def test_the_converted_spec_is_the_sources(source, converted):
    src, out = load_model(source), load_model(converted)
    assert {f: getattr(out, f) for f in FIELDS} == {f: getattr(src, f) for f in FIELDS}
    assert out.moe.sparse_layers == (0, 2, 3) and out.moe.top_k == 2 and out.moe.norm_topk_prob
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
            config["mlp_only_layers"]) == (8, 2, 32, [1])


def test_a_q8_0_conversion_quantizes_the_experts_and_keeps_the_routers_float(source, gguf_path, tmp_path):
    out = convert_gguf(gguf_path, tmp_path / "q8", progress=False, dtype="q8_0")
    with safe_open(str(out / "model.safetensors"), "np") as f:
        formats = json.loads(f.metadata()["mindserve.quantization"])
    names = load_file(str(source / "model.safetensors"))
    experts = [n for n in names if ".mlp.experts." in n]
    assert len(experts) == 3 * 8 * 3 and all(formats[n] == "q8_0" for n in experts)
    routers = [n for n in names if n.endswith("mlp.gate.weight")]
    assert len(routers) == 3 and not set(routers) & set(formats)
    assert load_model(out).weight_dtype == "q8_0"


def _golden() -> dict:
    return json.loads((GOLDEN_DIR / "qwen3_moe_tiny.json").read_text())["prompts"]["capital"]


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["aot", "stock"])
def test_the_converted_model_generates_as_its_source_and_hf(source, converted, kernels):
    from tests.support.runner import greedy, make_runner

    want = _golden()
    runs = [greedy(make_runner(d, num_blocks=8, kernels=kernels), want["input_ids"], 20, [1, 2, 3])
            for d in (source, converted)]
    assert runs[0][0] == runs[1][0] == want["greedy_ids"]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


class MoeActQuantRef(RefModel):
    """tests/support/reference_numpy.py's forward (float64) with Qwen3-MoE's routed experts written out here: the
    router's softmax, each token's top-k renormalised, the weighted sum of those experts' SwiGLU MLPs. Every matmul's
    input is quantized per row and block of 32 as the AOT kernels' Q8_0 matmuls do (tests/support/act_quant_ref.py),
    but the router's (a float32 matrix there). ``quantize_inputs`` False: the plain float64 forward."""

    quantize_inputs = True

    def _check_shapes(self) -> None:  # the dense layers' shapes only: the experts are checked by their use
        pass

    def _q(self, x: np.ndarray) -> np.ndarray:
        return act_quant_ref.quant_dequant(x) if self.quantize_inputs else x

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return super()._linear(self._q(x), name)

    def next_logits(self, ids: list[int]) -> np.ndarray:
        return self._q(self.hidden_states(ids))[-1] @ self.w["lm_head.weight"].T

    def _mlp(self, h: np.ndarray, p: str) -> np.ndarray:
        if p + "mlp.gate.weight" not in self.w:
            return super()._mlp(h, p)
        logits = h @ self.w[p + "mlp.gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            top = np.argsort(-probs[t], kind="stable")[:2]
            for e, weight in zip(top, probs[t, top] / probs[t, top].sum()):
                q, x = f"{p}mlp.experts.{e}.", h[t:t + 1]
                act = silu(self._linear(x, q + "gate_proj")) * self._linear(x, q + "up_proj")
                out[t] += weight * self._linear(act, q + "down_proj")[0]
        return out


@pytest.mark.slow
def test_q8_0_experts_on_the_aot_kernels_match_the_activation_quantizing_reference(gguf_path, tmp_path):
    """The AOT path multiplies the Q8_0 expert blocks in place (activations quantized to Q8_0 per 32, as llama.cpp
    does): prompt and decode logits within 5e-4 of the reference doing the same in float64 on the dequantized
    blocks (tests/backends/mindspore/network/test_quantized_model.py's tolerance), which leaving the activation
    quantization out misses by far."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from backends.mindspore.runners import DecodeRow
    from tests.support.runner import make_runner, prefill

    out = convert_gguf(gguf_path, tmp_path / "q8", progress=False, dtype="q8_0")
    with safe_open(str(out / "model.safetensors"), "np") as f:
        quantized = json.loads(f.metadata()["mindserve.quantization"])
    raw = load_file(str(out / "model.safetensors"))
    weights = {k: dequantize(v, GGMLQuantizationType.Q8_0).reshape(v.shape[0], -1) if k in quantized else v
               for k, v in raw.items()}
    config = dataclasses.replace(RefConfig.from_hf(json.loads((out / "config.json").read_text())), qk_norm=True)
    ref = MoeActQuantRef(config, weights)
    runner = make_runner(out, num_blocks=8, kernels="aot")
    assert str(runner.net.layers[0].w_gate_up.dtype).lower().startswith("uint8")  # the experts served as blocks
    ids, blocks = list(_golden()["input_ids"][:24]), [1, 2, 3]
    logits = prefill(runner, ids, blocks)
    np.testing.assert_allclose(logits, ref.next_logits(ids), atol=5e-4, rtol=0)
    for _ in range(8):
        ids.append(int(np.argmax(logits)))
        logits = runner.decode([DecodeRow(ids[-1], len(ids) - 1, blocks)])[0]
        np.testing.assert_allclose(logits, ref.next_logits(ids), atol=5e-4, rtol=0)
    ref.quantize_inputs = False
    assert np.abs(logits - ref.next_logits(ids)).max() > 20 * 5e-4
