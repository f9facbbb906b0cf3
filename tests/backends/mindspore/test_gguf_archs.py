"""convert-gguf for the ``qwen2`` and ``qwen3`` architectures (and the refusal of any other): the tiny HF
checkpoints written as float32 GGUFs the way llama.cpp lays them out (tests/support/hf_to_gguf.py, independent of
the converter) convert back to the HF tensors bit for bit, with a config and predict yaml the loader reads as the
source's; the converted Qwen3 gives the same greedy ids and logits as its safetensors source, and so HF's."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from backends.mindspore.families import load_model
from backends.mindspore.sources.gguf_archs import UnsupportedGguf
from backends.mindspore.sources.gguf_convert import convert_gguf
from backends.mindspore.modeldir.tokenizer import Tokenizer
from tests.support.gguf_rows import TINY_TOKENS
from tests.support.hf_to_gguf import write_gguf
from tests.support.families import BY_NAME
from tests.support.paths import GOLDEN_DIR

SAME_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
               "vocab_size", "rms_norm_eps", "rope_theta", "qkv_has_bias", "tie_word_embeddings", "qk_norm",
               "eos_token_ids", "bos_token_id", "pad_token_id")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoints of the families whose GGUF architecture is the family's name (tests/support/families.py),
    keyed by that name."""
    root = tmp_path_factory.mktemp("gguf_src")
    return {arch: BY_NAME[arch].make_for_gguf(root / arch) for arch in ("qwen3", "qwen2", "llama")}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_out")
    return {arch: convert_gguf(write_gguf(src, root / f"{arch}.gguf", arch), root / arch, progress=False)
            for arch, src in sources.items()}


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_tensors_come_back_as_the_hf_source(sources, converted, arch):
    """Every tensor, bit for bit: qwen2/qwen3 rows are not permuted (NEOX RoPE), llama's are un-permuted; the q/k/v
    biases and q/k head norms come back exactly where the family's defaults declare them (qwen2's biases, qwen3's
    head norms)."""
    want = load_file(str(sources[arch] / "model.safetensors"))
    got = load_file(str(converted[arch] / "model.safetensors"))
    assert set(got) == set(want)
    for name, tensor in want.items():
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    defaults = BY_NAME[arch].family.defaults
    assert ("model.layers.0.self_attn.q_proj.bias" in got) == defaults.qkv_bias
    assert ("model.layers.0.self_attn.q_norm.weight" in got) == defaults.qk_norm


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_the_converted_spec_is_the_sources(sources, converted, arch):
    src, out = load_model(sources[arch]), load_model(converted[arch])
    assert {f: getattr(out, f) for f in SAME_FIELDS} == {f: getattr(src, f) for f in SAME_FIELDS}
    config = json.loads((converted[arch] / "config.json").read_text())
    hf = BY_NAME[arch].arch
    assert out.arch == hf  # (the tiny Qwen2's own yaml says LlamaForCausalLM with qkv_has_bias)
    assert config["architectures"] == [hf] and config["model_type"] == arch
    (yaml_path,) = converted[arch].glob("*.yaml")
    assert yaml.safe_load(yaml_path.read_text())["model"]["arch"]["type"] == hf


def test_the_converted_tokenizer_encodes_as_the_source(sources, converted):
    chat = json.loads((GOLDEN_DIR / "qwen3_tiny.json").read_text())["prompts"]["story"]
    ours = Tokenizer.from_model_dir(converted["qwen3"])
    assert ours.encode(chat["chat"]) == Tokenizer.from_model_dir(sources["qwen3"]).encode(chat["chat"])
    assert ours.encode(chat["chat"]) == chat["input_ids"]


@pytest.mark.parametrize("arch", ["gemma2", "phi3", None])
def test_another_architecture_is_refused_by_name_with_the_supported_list(tmp_path, arch):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), arch or "llama")
    if arch is None:  # a file without general.architecture
        w.kv_data[0].pop("general.architecture")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TINY_TOKENS)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGguf, match=rf"general.architecture {arch!r}: convert-gguf imports 'llama', "
                                              r"'qwen2', 'qwen3'"):
        convert_gguf(path, tmp_path / "m", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["aot", "stock"])
def test_the_converted_qwen3_generates_as_its_safetensors_source(sources, converted, kernels):
    """fp32 conversion: the same greedy ids and the same logits as the safetensors path (and so HF's goldens)."""
    from tests.support.runner import greedy, make_runner

    want = json.loads((GOLDEN_DIR / "qwen3_tiny.json").read_text())["prompts"]["capital"]
    runs = [greedy(make_runner(d, num_blocks=8, kernels=kernels), want["input_ids"], 20, [1, 2, 3])
            for d in (sources["qwen3"], converted["qwen3"])]
    assert runs[0][0] == runs[1][0] == want["greedy_ids"]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_a_q8_0_conversion_keeps_the_head_norms_and_biases_float(sources, tmp_path):
    """--dtype q8_0: every matrix becomes Q8_0 blocks; the q/k head norms (qwen3) and biases (qwen2) stay float32."""
    from safetensors import safe_open

    for arch in ("qwen3", "qwen2"):
        out = convert_gguf(write_gguf(sources[arch], tmp_path / f"{arch}.gguf", arch), tmp_path / arch,
                           progress=False, dtype="q8_0")
        with safe_open(str(out / "model.safetensors"), "np") as f:
            formats = json.loads(f.metadata()["mindserve.quantization"])
        vectors = [n for n in load_file(str(sources[arch] / "model.safetensors")) if n.endswith(("norm.weight",
                                                                                                "bias"))]
        assert vectors and not set(vectors) & set(formats)
        assert formats["model.layers.0.self_attn.q_proj.weight"] == "q8_0"
        assert load_model(out).weight_dtype == "q8_0"
