"""convert-gguf --dtype fp32|q8_0|as-shipped on tiny synthetic GGUFs whose matrices are Q4_1 / Q8_0 / F32 blocks
(written and quantized by the `gguf` package): what is kept byte for byte, what is requantized, what the yaml
and the safetensors metadata record, and how the loader reads it back."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import yaml
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors import safe_open

from backends.mindspore.modeldir.yaml_tree import ConfigError

from backends.mindspore.families import load_model
from backends.mindspore.sources.gguf_convert import convert_gguf, is_complete_conversion
from backends.mindspore.modeldir.quant import QuantWeight
from backends.mindspore.modeldir.weights import check_weight_dtype, load_weights
from tests.support.gguf_rows import TINY_TOKENS, hf_to_gguf_rows

HIDDEN, FFN = 64, 96
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (32, HIDDEN), "attn_v": (32, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
HEADS = {"attn_q": 4, "attn_k": 2}  # head_dim 16


def _write(path: Path, layer_type: T = T.Q4_1, embed_type: T = T.Q8_0, seed: int = 0) -> dict[str, np.ndarray]:
    """A 1-layer llama GGUF (hidden 64, 4 heads, 2 kv heads, tied head); returns its HF-layout float weights."""
    rng = np.random.default_rng(seed)
    hf = {k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in SHAPES.items()}
    hf["token_embd"] = (rng.standard_normal((len(TINY_TOKENS), HIDDEN)) * 0.1).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_rope_freq_base, 1e4), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "smollm"),
                       (w.add_token_list, TINY_TOKENS), (w.add_token_types, [3, 3, 3, 1, 1, 1, 1, 1]),
                       (w.add_token_merges, ["a b", "Ġ ab"]), (w.add_bos_token_id, 1), (w.add_eos_token_id, 2)]:
        add(value)

    def tensor(name: str, array: np.ndarray, kind: T) -> None:
        if kind == T.F32:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, quantize(array, kind), raw_dtype=kind)  # its shape in bytes per row

    tensor("token_embd.weight", hf["token_embd"], embed_type)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", np.ones(HIDDEN, np.float32))
    for k in SHAPES:
        tensor(f"blk.0.{k}.weight", hf_to_gguf_rows(hf[k], HEADS[k]) if k in HEADS else hf[k], layer_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _tensors(out: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["mindserve.quantization"])


def _model_config(out: Path) -> dict:
    return yaml.safe_load(next(out.glob("predict_*.yaml")).read_text())["model"]["model_config"]


def test_as_shipped_keeps_the_blocks_byte_for_byte(tmp_path):
    hf = _write(tmp_path / "t.gguf")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False, dtype="as-shipped")
    tensors, names = _tensors(out)
    # Quantization is per row, so the un-permuted rows of blocks are the blocks of the HF rows.
    for k, hf_name in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("ffn_down", "mlp.down_proj")]:
        name = f"model.layers.0.{hf_name}.weight"
        assert names[name] == "q4_1" and tensors[name].dtype == np.uint8
        np.testing.assert_array_equal(tensors[name], quantize(hf[k], T.Q4_1).reshape(SHAPES[k][0], -1))
    assert names["model.embed_tokens.weight"] == "q8_0"
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], quantize(hf["token_embd"], T.Q8_0))
    assert tensors["model.norm.weight"].dtype == np.float32 and "model.norm.weight" not in names
    assert _model_config(out)["weight_dtype"] == "q4_1"
    assert json.loads((out / "conversion.json").read_text())["dtype"] == "as-shipped"


# A Q4_K_M-like one-layer GGUF, wide enough for super-blocks of 256 (the gguf package cannot write K-quants:
# quant.quantize's blocks, handed to its writer as raw bytes).
WIDE, WIDE_FFN = 256, 512
WIDE_SHAPES = {"attn_q": (WIDE, WIDE), "attn_k": (128, WIDE), "attn_v": (128, WIDE), "attn_output": (WIDE, WIDE),
               "ffn_gate": (WIDE_FFN, WIDE), "ffn_up": (WIDE_FFN, WIDE), "ffn_down": (WIDE, WIDE_FFN)}
WIDE_KINDS = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q5_0", "ffn_gate": "q5_k",
              "ffn_up": "q5_1", "ffn_down": "q6_k", "token_embd": "q6_k"}


def _write_k(path: Path) -> dict[str, QuantWeight]:
    from backends.mindspore.modeldir.quant import quantize as quant_quantize

    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, WIDE),
                       (w.add_feed_forward_length, WIDE_FFN), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_rope_freq_base, 1e4), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "smollm"),
                       (w.add_token_list, TINY_TOKENS), (w.add_token_types, [3, 3, 3, 1, 1, 1, 1, 1]),
                       (w.add_token_merges, ["a b", "Ġ ab"]), (w.add_bos_token_id, 1), (w.add_eos_token_id, 2)]:
        add(value)
    blocks = {}
    for k, shape in {**WIDE_SHAPES, "token_embd": (len(TINY_TOKENS), WIDE)}.items():
        blocks[k] = quant_quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), WIDE_KINDS[k])
        name = "token_embd.weight" if k == "token_embd" else f"blk.0.{k}.weight"
        w.add_tensor(name, blocks[k].blocks, raw_dtype=T[WIDE_KINDS[k].upper()])
    w.add_tensor("output_norm.weight", np.ones(WIDE, np.float32))
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", np.ones(WIDE, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return blocks


_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj"}


def test_as_shipped_keeps_k_quant_and_q5_blocks_and_q8_0_requantizes_them(tmp_path):
    from backends.mindspore.sources.gguf_convert import unpermute_qk_rows

    blocks = _write_k(tmp_path / "k.gguf")
    out = convert_gguf(tmp_path / "k.gguf", tmp_path / "m", progress=False, dtype="as-shipped")
    tensors, names = _tensors(out)
    for k, hf_name in _HF.items():
        name = f"model.layers.0.{hf_name}.weight"
        assert names[name] == WIDE_KINDS[k] and tensors[name].dtype == np.uint8
        want = blocks[k].blocks
        if k in ("attn_q", "attn_k"):  # llama.cpp's row permutation undone, whole rows of blocks
            want = unpermute_qk_rows(want, {"attn_q": 4, "attn_k": 2}[k])
        np.testing.assert_array_equal(tensors[name], want)
    assert names["model.embed_tokens.weight"] == "q6_k"
    assert _model_config(out)["weight_dtype"] == "mixed"
    weights = load_weights(*(lambda s: (s.checkpoint, s.checkpoint_format))(load_model(out)))
    v = weights["model.layers.0.self_attn.v_proj.weight"]
    assert (v.fmt, v.shape) == ("q6_k", WIDE_SHAPES["attn_v"])
    np.testing.assert_array_equal(v.dequantize(), dequantize(blocks["attn_v"].blocks, T.Q6_K).reshape(128, WIDE))
    q8 = convert_gguf(tmp_path / "k.gguf", tmp_path / "q8", progress=False, dtype="q8_0")
    tensors, names = _tensors(q8)
    assert set(names.values()) == {"q8_0"}
    np.testing.assert_array_equal(tensors["model.layers.0.mlp.down_proj.weight"],
                                  quantize(dequantize(blocks["ffn_down"].blocks, T.Q6_K).reshape(WIDE, WIDE_FFN),
                                           T.Q8_0))


def test_q8_0_requantizes_from_the_source_and_float_tensors_too(tmp_path):
    _write(tmp_path / "t.gguf", layer_type=T.Q4_1, embed_type=T.F32)
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False, dtype="q8_0")
    tensors, names = _tensors(out)
    reader = gguf.GGUFReader(tmp_path / "t.gguf")
    src = {t.name: t for t in reader.tensors}
    up = src["blk.0.ffn_up.weight"]
    want = quantize(dequantize(up.data, up.tensor_type).reshape(FFN, HIDDEN), T.Q8_0)
    np.testing.assert_array_equal(tensors["model.layers.0.mlp.up_proj.weight"], want)
    embed = np.asarray(src["token_embd.weight"].data, np.float32).reshape(len(TINY_TOKENS), HIDDEN)
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], quantize(embed, T.Q8_0))
    assert set(names.values()) == {"q8_0"} and len(names) == 1 + len(SHAPES)
    assert _model_config(out)["weight_dtype"] == "q8_0"


def test_as_shipped_keeps_float_matrices_float(tmp_path):
    _write(tmp_path / "t.gguf", layer_type=T.F32, embed_type=T.F32)
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False, dtype="as-shipped")
    tensors, names = _tensors(out)
    assert names == {} and all(t.dtype == np.float32 for t in tensors.values())
    assert "weight_dtype" not in _model_config(out)  # absent means float32, as in an fp32 conversion


def test_fp32_dequantizes_and_the_dtype_is_part_of_the_conversion(tmp_path):
    hf = _write(tmp_path / "t.gguf")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    tensors, names = _tensors(out)
    assert names == {}
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.k_proj.weight"],
                                  dequantize(quantize(hf["attn_k"], T.Q4_1), T.Q4_1))
    assert is_complete_conversion(out, tmp_path / "t.gguf", dtype="fp32")
    assert not is_complete_conversion(out, tmp_path / "t.gguf", dtype="as-shipped")
    convert_gguf(tmp_path / "t.gguf", out, progress=False, dtype="as-shipped")  # replaces the fp32 one
    assert _tensors(out)[1]["model.layers.0.self_attn.k_proj.weight"] == "q4_1"


def test_unknown_dtype_is_named(tmp_path):
    _write(tmp_path / "t.gguf")
    with pytest.raises(ValueError, match="dtype: must be one of fp32, q8_0, as-shipped, got 'q4_k'"):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False, dtype="q4_k")


def test_the_loader_reads_blocks_back_and_checks_the_yaml(tmp_path):
    hf = _write(tmp_path / "t.gguf")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False, dtype="as-shipped")
    spec = load_model(out)
    assert spec.weight_dtype == "q4_1"
    weights = load_weights(spec.checkpoint, spec.checkpoint_format)
    k = weights["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k, QuantWeight) and (k.fmt, k.shape) == ("q4_1", SHAPES["attn_k"])
    np.testing.assert_array_equal(k.dequantize(), dequantize(quantize(hf["attn_k"], T.Q4_1), T.Q4_1))
    assert weights["model.norm.weight"].dtype == np.float32
    check_weight_dtype(weights, spec.yaml_path, spec.weight_dtype)
    with pytest.raises(ConfigError, match=r"model.model_config.weight_dtype: says float32, but the checkpoint's "
                                          r"layer matrices are q4_1"):
        check_weight_dtype(weights, spec.yaml_path, "float32")


def test_a_bad_weight_dtype_in_the_yaml_is_named(tmp_path):
    _write(tmp_path / "t.gguf")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False, dtype="as-shipped")
    y = next(out.glob("predict_*.yaml"))
    y.write_text(y.read_text().replace("weight_dtype: q4_1", "weight_dtype: q3_k"))
    with pytest.raises(ConfigError, match=r"model.model_config.weight_dtype: must be one of .*got 'q3_k'"):
        load_model(out)


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-q8_0", "SmolLM2-135M-Instruct-Q4_1"])
def test_each_default_directory_is_left_for_serve_to_prepare(tmp_path, name):
    from backends.mindspore.sources.default_model import DEFAULT_DIRS
    from service.config import load_server_config
    from service.preflight import check_model
    from tests.support.cli import server_config

    assert name in DEFAULT_DIRS
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(server_config(tmp_path / name)))
    assert not check_model(load_server_config(path)).prepared  # absent: serve converts it with its --dtype


def test_the_shipped_config_serves_the_default_gguf_as_shipped():
    from backends.mindspore.sources.default_model import DEFAULT_DIRS
    from service.config import load_server_config
    from tests.support.paths import REPO

    path = load_server_config(REPO / "configs" / "server.yaml").model.weight_path
    assert DEFAULT_DIRS[path.name] == "as-shipped"


def test_an_unknown_default_directory_name_is_refused(tmp_path):
    from backends.mindspore.sources.default_model import ensure_default_model

    with pytest.raises(ValueError, match="'SmolLM2-135M-Instruct-q4_k' is not a default model directory"):
        ensure_default_model(tmp_path, name="SmolLM2-135M-Instruct-q4_k")


def test_the_memory_budget_counts_blocks_as_they_are(tmp_path):
    """Quantized tensors count their bytes, not 4 per byte; the quantized embedding also its float32 table."""
    from backends.mindspore.planning.memory import weights_bytes

    _write(tmp_path / "t.gguf")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False, dtype="as-shipped")
    tensors, names = _tensors(out)
    want = sum(t.nbytes if n in names else t.size * 4 for n, t in tensors.items())
    want += len(TINY_TOKENS) * HIDDEN * 4  # the embedding's lookup table, dequantized at load
    assert weights_bytes(out / "model.safetensors") == want
    fp32 = convert_gguf(tmp_path / "t.gguf", tmp_path / "f", progress=False)
    assert weights_bytes(fp32 / "model.safetensors") == sum(t.size * 4 for t in _tensors(fp32)[0].values())
