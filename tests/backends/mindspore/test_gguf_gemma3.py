"""convert-gguf for the ``gemma3`` architecture: the tiny Gemma 3 checkpoint in the layout a GGUF can describe
(make_tiny_gemma3's ``llama_cpp`` variant: 7 layers, every 6th global, query_pre_attn_scalar = head_dim), written as
a float32 GGUF the way llama.cpp lays it out (tests/support/hf_to_gguf.py: norms stored as 1 + w, Gemma's
post-norm tensor names, the window and the linear rope scaling in the metadata), converts back to the HF tensors bit
for bit, to a spec the loader reads as the source's, and generates as its safetensors source; a SentencePiece GGUF
tokenizer (what real Gemma GGUFs carry) is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from backends.mindspore.families import load_model
from backends.mindspore.sources.gguf_convert import convert_gguf
from tests.support.hf_to_gguf import write_gguf
from tests.support.make_tiny_gemma3 import make_tiny_gemma3
from tests.support.paths import GOLDEN_DIR

SAME_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
               "vocab_size", "rms_norm_eps", "rope_theta", "qkv_has_bias", "tie_word_embeddings", "qk_norm",
               "eos_token_ids", "bos_token_id", "pad_token_id", "gemma3", "arch")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3_src"), llama_cpp=True)


@pytest.fixture(scope="module")
def gguf_path(source, tmp_path_factory) -> Path:
    return write_gguf(source, tmp_path_factory.mktemp("gemma3_gguf") / "gemma3.gguf", "gemma3")


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory) -> Path:
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("gemma3_out") / "m", progress=False)


def test_tensors_come_back_as_the_hf_source(source, converted):
    """Every tensor bit for bit, the pre-/post-norm names mapped back; the norms as the network uses them: the file
    holds fl(1 + w) only, and 1 + (fl(1 + w) - 1) gives fl(1 + w) back (the subtraction is exact for 1 + w in
    [0.5, 4)), so the (1 + w) the network uses is the source's bit for bit (w itself may differ in its last bits)."""
    want = load_file(str(source / "model.safetensors"))
    got = load_file(str(converted / "model.safetensors"))
    assert set(got) == set(want)
    one = np.float32(1)
    for name, tensor in want.items():
        if name.endswith("norm.weight"):
            np.testing.assert_array_equal(got[name] + one, tensor + one, err_msg=name)
            np.testing.assert_allclose(got[name], tensor, rtol=0, atol=2.5e-7, err_msg=name)  # an ulp of 1 + w
        else:
            np.testing.assert_array_equal(got[name], tensor, err_msg=name)


def test_the_converted_spec_is_the_sources(source, converted):
    src, out = load_model(source), load_model(converted)
    assert {f: getattr(out, f) for f in SAME_FIELDS} == {f: getattr(src, f) for f in SAME_FIELDS}
    assert out.gemma3.sliding_layers == (True,) * 5 + (False, True) and out.gemma3.sliding_window == 8
    assert out.gemma3.rope_scaling_factor == 2.0 and out.gemma3.attn_scale == 32 ** -0.5
    assert json.loads((converted / "config.json").read_text())["model_type"] == "gemma3_text"


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["aot", "stock"])
def test_the_converted_gemma3_generates_as_its_safetensors_source(source, converted, kernels):
    """fp32 conversion: the same greedy ids and the same logits as the safetensors path."""
    from tests.support.runner import greedy, make_runner

    ids = json.loads((GOLDEN_DIR / "gemma3_tiny.json").read_text())["prompts"]["capital"]["input_ids"]
    runs = [greedy(make_runner(d, num_blocks=8, kernels=kernels), ids, 16, [1, 2, 3]) for d in (source, converted)]
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.slow
def test_a_q8_0_conversion_runs_on_the_quantized_kernels(gguf_path, converted, tmp_path):
    """--dtype q8_0: the matrices as Q8_0 blocks (norms float32) through the AOT quantized matmuls inside the Gemma
    layer op; the logits stay close to the float32 conversion's (weights and activations rounded to 8 bits)."""
    from tests.support.runner import greedy, make_runner

    q8 = convert_gguf(gguf_path, tmp_path / "q8", progress=False, dtype="q8_0")
    assert load_model(q8).weight_dtype == "q8_0"
    ids = json.loads((GOLDEN_DIR / "gemma3_tiny.json").read_text())["prompts"]["capital"]["input_ids"]
    want = greedy(make_runner(converted, num_blocks=8, kernels="aot"), ids, 4, [1, 2, 3])[1]
    got = greedy(make_runner(q8, num_blocks=8, kernels="aot"), ids, 4, [1, 2, 3])[1]
    # the tiny model's logits are small (|max| ~0.5): weight rounding alone (the stock ops on the dequantized q8_0
    # weights) moves them ~0.024, activation rounding as much again; they stay correlated
    assert np.corrcoef(got[0], want[0])[0, 1] > 0.99
