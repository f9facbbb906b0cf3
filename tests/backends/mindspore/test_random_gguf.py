"""bench/make_random_gguf.py: the file it writes for a tiny shape has the tensors, types and metadata a llama.cpp
file of that shape has (checked against shapes written out here, read back with the `gguf` package's reader), the
default model's tokenizer, and converts with our convert-gguf."""
from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from safetensors import safe_open

from backends.mindspore.sources.gguf_convert import convert_gguf

REPO = Path(__file__).resolve().parents[3]


def _module():
    spec = importlib.util.spec_from_file_location("make_random_gguf", REPO / "bench" / "make_random_gguf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mrg = _module()

# The tiny preset: hidden 64, 2 layers, 4 heads of 16, 2 kv heads, ffn 128, the default model's 49152 tokens.
TINY_LAYER = {"attn_norm": ((64,), "F32"), "attn_q": ((64, 64), "W"), "attn_k": ((32, 64), "W"),
              "attn_v": ((32, 64), "W"), "attn_output": ((64, 64), "W"), "ffn_norm": ((64,), "F32"),
              "ffn_gate": ((128, 64), "W"), "ffn_up": ((128, 64), "W"), "ffn_down": ((64, 128), "W")}


def _read(path: Path) -> tuple[dict[str, tuple[tuple[int, ...], str, object]], dict]:
    """{name: (numpy shape, GGML type, tensor)} and the fields, from one read (~6 s: the tokenizer's arrays)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name, t) for t in reader.tensors}, \
        reader.fields


@pytest.mark.parametrize(("wtype", "big"), [("Q4_1", "Q8_0"), ("Q4_0", "Q8_0"), ("F16", "F16")])
def test_tiny_file_has_the_presets_tensors_and_types(tmp_path, default_gguf_path, wtype, big):
    out = mrg.write(mrg.PRESETS["tiny"], tmp_path / "t.gguf", wtype, tokenizer_gguf=default_gguf_path,
                    progress=False)
    want = {"token_embd.weight": ((49152, 64), big), "output_norm.weight": ((64,), "F32")}
    for i in range(2):
        want |= {f"blk.{i}.{k}.weight": (s, wtype if t == "W" else t) for k, (s, t) in TINY_LAYER.items()}
    got, fields = _read(out)
    assert {k: v[:2] for k, v in got.items()} == want
    # N(0, 1/fan_in) weights, norms ones.
    down = got["blk.1.ffn_down.weight"][2]
    values = dequantize(down.data, down.tensor_type).reshape(64, 128)
    assert abs(float(values.std()) - 128 ** -0.5) < 0.15 * 128 ** -0.5
    assert np.all(np.asarray(got["output_norm.weight"][2].data) == 1)
    meta = {k: fields[k].contents() for k in ("general.architecture", "llama.embedding_length", "llama.block_count",
                                             "llama.attention.head_count", "llama.attention.head_count_kv",
                                             "llama.feed_forward_length", "llama.rope.dimension_count")}
    assert meta == {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 2,
                    "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
                    "llama.feed_forward_length": 128, "llama.rope.dimension_count": 16}


def test_the_tokenizer_is_the_default_models(tmp_path, default_gguf_path):
    out = mrg.write(mrg.PRESETS["tiny"], tmp_path / "t.gguf", "Q8_0", tokenizer_gguf=default_gguf_path,
                    progress=False)
    fields, source = gguf.GGUFReader(str(out)).fields, gguf.GGUFReader(str(default_gguf_path)).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.pre",
                "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"):
        assert fields[key].contents() == source[key].contents(), key


def test_tiny_file_converts_as_shipped(tmp_path, default_gguf_path, default_model_dir):
    src = mrg.write(mrg.PRESETS["tiny"], tmp_path / "t.gguf", "Q4_1", tokenizer_gguf=default_gguf_path,
                    progress=False)
    out = convert_gguf(src, tmp_path / "m", progress=False, dtype="as-shipped")
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings")} == {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 49152, "head_dim": 16, "tie_word_embeddings": True}
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        formats = json.loads(f.metadata()["mindserve.quantization"])
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    # Q4_1 rows of 64 are 2 blocks of 20 bytes; Q8_0 rows 2 blocks of 34.
    assert formats["model.layers.1.mlp.gate_proj.weight"] == "q4_1"
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (128, 40)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 80)
    assert formats["model.embed_tokens.weight"] == "q8_0" and shapes["model.embed_tokens.weight"] == (49152, 68)
    assert len(shapes) == 2 + 2 * len(TINY_LAYER)
    tok = json.loads((out / "tokenizer.json").read_text())
    assert tok["model"]["vocab"] == json.loads((default_model_dir / "tokenizer.json").read_text())["model"]["vocab"]


def test_qwen3moe_file_has_expert_tensors(tmp_path, default_gguf_path):
    shape = replace(mrg.PRESETS["qwen3moe-small"], hidden=64, layers=1, heads=4, kv_heads=2, head_dim=32, ffn=32,
                    experts=4, experts_used=2)
    got, fields = _read(mrg.write(shape, tmp_path / "m.gguf", "Q8_0", tokenizer_gguf=default_gguf_path,
                                  progress=False))
    assert got["blk.0.attn_q.weight"][:2] == ((128, 64), "Q8_0")
    assert got["blk.0.attn_q_norm.weight"][:2] == ((32,), "F32")
    assert got["blk.0.ffn_gate_inp.weight"][:2] == ((4, 64), "F32")
    assert got["blk.0.ffn_gate_exps.weight"][:2] == ((4, 32, 64), "Q8_0")
    assert got["blk.0.ffn_down_exps.weight"][:2] == ((4, 64, 32), "Q8_0")
    assert "blk.0.ffn_gate.weight" not in got
    assert fields["qwen3moe.expert_count"].contents() == 4 and fields["qwen3moe.expert_used_count"].contents() == 2


def test_bad_requests_are_named(tmp_path, default_gguf_path):
    with pytest.raises(ValueError, match="type 'Q4_K_M': written directly are"):
        mrg.write(mrg.PRESETS["tiny"], tmp_path / "t.gguf", "Q4_K_M", tokenizer_gguf=default_gguf_path)
    with pytest.raises(ValueError, match="token_embd.weight .*rows of 48 are not whole Q8_0 blocks of 32"):
        mrg.write(replace(mrg.PRESETS["tiny"], hidden=48, heads=3), tmp_path / "t.gguf", "Q4_1",
                  tokenizer_gguf=default_gguf_path, progress=False)
    with pytest.raises(ValueError, match="vocab 1000: the tokenizer"):
        mrg.write(replace(mrg.PRESETS["tiny"], vocab=1000), tmp_path / "t.gguf", "Q4_1",
                  tokenizer_gguf=default_gguf_path, progress=False)


@pytest.mark.skipif(not (mrg.ANCHORS / "llama-quantize").exists(),
                    reason="llama-quantize not built (~/.cache/llama-anchors; ../shared/tools/build-llama-anchors.sh)")
def test_k_quant_via_llama_quantize(tmp_path, default_gguf_path):
    shape = replace(mrg.PRESETS["tiny"], hidden=256, heads=4, ffn=512)  # K-quant rows are blocks of 256
    got, _ = _read(mrg.make(shape, tmp_path / "k.gguf", "Q4_K_M", tokenizer_gguf=default_gguf_path, progress=False))
    assert {t for _, t, _ in got.values()} & {"Q4_K", "Q6_K"}
    assert not (tmp_path / "k.gguf.f16.gguf").exists()
