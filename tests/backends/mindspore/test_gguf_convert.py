"""GGUF → model directory: files, config values, weights (Q/K un-permutation proved via RoPE
scores against the raw GGUF), idempotency, and error cases on tiny synthetic GGUFs."""
from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import yaml
from gguf.quants import dequantize
from safetensors import safe_open

from backends.mindspore.sources.default_model import MODEL_NAME, ensure_default_model
from backends.mindspore.sources.gguf_convert import convert_gguf
from backends.mindspore.modeldir.tokenizer import Tokenizer
from tests.support.gguf_rows import TINY_TOKENS, hf_to_gguf_rows

PROMPT_IDS = [5965, 1462, 314, 11256, 380, 1153, 284, 339]  # "My name is Olivier and I"
HF_FP32_GREEDY = [5248, 1535, 288, 724]  # cpu-performance-anchors.md §2 (HF fp32, no BOS)
EXPECTED_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "model.safetensors", f"predict_{MODEL_NAME}.yaml", "conversion.json"}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


# --- the default model (real GGUF) ---

def test_converted_dir_has_all_files(default_model_dir: Path) -> None:
    assert {p.name for p in default_model_dir.iterdir()} == EXPECTED_FILES


def test_config_json_values(default_model_dir: Path) -> None:
    cfg = _json(default_model_dir / "config.json")
    expected = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
                "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "float32",
                "hidden_act": "silu", "attention_bias": False}
    assert {k: cfg[k] for k in expected} == expected
    assert _json(default_model_dir / "generation_config.json")["eos_token_id"] == 2


def test_predict_yaml(default_model_dir: Path) -> None:
    tree = yaml.safe_load((default_model_dir / f"predict_{MODEL_NAME}.yaml").read_text())
    assert tree["run_mode"] == "predict" and tree["load_ckpt_format"] == "safetensors"
    assert (default_model_dir / tree["load_checkpoint"]).is_file()
    assert tree["context"] == {"mode": 0, "device_target": "CPU"}
    assert tree["model"]["arch"] == {"type": "LlamaForCausalLM"}
    mc = tree["model"]["model_config"]
    assert (mc["num_layers"], mc["hidden_size"], mc["num_heads"], mc["n_kv_heads"]) == (30, 576, 9, 3)
    assert (mc["vocab_size"], mc["seq_length"], mc["theta"], mc["rms_norm_eps"]) == (49152, 8192, 1e5, 1e-5)
    assert mc["tie_word_embeddings"] is True and mc["qkv_has_bias"] is False and mc["use_past"] is True
    assert tree["processor"]["tokenizer"] == {"type": "PreTrainedTokenizerFast",
                                              "tokenizer_file": "tokenizer.json"}


def test_tokenizer_config(default_model_dir: Path) -> None:
    cfg = _json(default_model_dir / "tokenizer_config.json")
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert cfg["added_tokens_decoder"]["2"] == {"content": "<|im_end|>", "lstrip": False,
                                                "normalized": False, "rstrip": False,
                                                "single_word": False, "special": True}
    assert len(cfg["added_tokens_decoder"]) == 17 and "<|im_start|>" in cfg["chat_template"]


def test_weights_names_shapes_dtype(default_model_dir: Path) -> None:
    with safe_open(default_model_dir / "model.safetensors", framework="numpy") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.29.mlp.down_proj.weight").get_shape() == [576, 1536]
        assert f.get_tensor("model.norm.weight").dtype == np.float32
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names  # tied head


@pytest.fixture(scope="module")
def raw_gguf(default_gguf_path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(default_gguf_path).tensors}


def _dequantized(t: gguf.ReaderTensor) -> np.ndarray:
    """Raw GGUF rows (no un-permutation), float64. GGUF lists dims innermost-first."""
    return dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)]).astype(np.float64)


def _rope_interleaved(v: np.ndarray, pos: int, base: float) -> np.ndarray:
    """llama.cpp "normal" RoPE: rotates adjacent pairs (2i, 2i+1). v: [heads, hd]."""
    hd = v.shape[-1]
    ang = pos * base ** (-np.arange(0, hd, 2) / hd)
    a, b = v[..., 0::2], v[..., 1::2]
    out = np.empty_like(v)
    out[..., 0::2], out[..., 1::2] = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
    return out


def _rope_half(v: np.ndarray, pos: int, base: float) -> np.ndarray:
    """HF rotate_half RoPE: rotates pairs (i, i + hd/2). v: [heads, hd]."""
    hd = v.shape[-1]
    ang = np.tile(pos * base ** (-np.arange(0, hd, 2) / hd), 2)
    rotated = np.concatenate([-v[..., hd // 2:], v[..., :hd // 2]], axis=-1)
    return v * np.cos(ang) + rotated * np.sin(ang)


def _scores(wq: np.ndarray, wk: np.ndarray, x: np.ndarray, rope, base: float) -> np.ndarray:
    """RoPE'd q·k for every (query pos, key pos) pair and head (GQA 9:3). x: [T, 576]."""
    q = [rope((wq @ x[m]).reshape(9, 64), m, base) for m in range(len(x))]
    k = [rope((wk @ x[n]).reshape(3, 64), n, base) for n in range(len(x))]
    return np.array([[np.einsum("hgd,hd->hg", q[m].reshape(3, 3, 64), k[n]) for n in range(len(x))]
                     for m in range(len(x))])


@pytest.mark.parametrize("layer", [0, 17])
def test_qk_unpermute_preserves_rope_attention_scores(default_model_dir: Path, raw_gguf: dict,
                                                      layer: int) -> None:
    """GGUF weights under GGUF's interleaved RoPE and converted weights under HF rotate_half
    must give the same attention scores; the raw weights under rotate_half must not."""
    raw_q = _dequantized(raw_gguf[f"blk.{layer}.attn_q.weight"])
    raw_k = _dequantized(raw_gguf[f"blk.{layer}.attn_k.weight"])
    with safe_open(default_model_dir / "model.safetensors", framework="numpy") as f:
        hf_q = f.get_tensor(f"model.layers.{layer}.self_attn.q_proj.weight").astype(np.float64)
        hf_k = f.get_tensor(f"model.layers.{layer}.self_attn.k_proj.weight").astype(np.float64)
    x = np.random.default_rng(layer).standard_normal((6, 576))
    reference = _scores(raw_q, raw_k, x, _rope_interleaved, 1e5)
    np.testing.assert_allclose(_scores(hf_q, hf_k, x, _rope_half, 1e5), reference,
                               rtol=1e-9, atol=1e-9 * np.abs(reference).max())
    wrong = _scores(raw_q, raw_k, x, _rope_half, 1e5)
    assert np.abs(wrong - reference).max() > 1e-2 * np.abs(reference).max()


def test_converted_weights_reproduce_hf_greedy(default_model_dir: Path) -> None:
    from tests.support.reference_numpy import (
        RefModel,  # the project's independent NumPy oracle
    )

    assert RefModel.from_dir(default_model_dir).greedy(PROMPT_IDS, 4) == HF_FP32_GREEDY


def test_conversion_is_idempotent(default_model_dir: Path, default_gguf_path: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()}
    started = time.perf_counter()
    out = convert_gguf(default_gguf_path, default_model_dir, model_name=MODEL_NAME, progress=False)
    again = ensure_default_model(default_model_dir.parent, progress=False)
    assert time.perf_counter() - started < 1.0
    assert out == again == default_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()} == before


# --- tiny synthetic GGUFs ---

def _tiny_gguf(path: Path, *, tokenizer_model: str = "gpt2", add_bos: bool = False,
               with_output: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a 1-layer llama GGUF (hidden 8, heads 2, kv 1); return its HF-layout weights."""
    rng = np.random.default_rng(seed)
    shapes = {"attn_norm": (8,), "ffn_norm": (8,), "attn_q": (8, 8), "attn_k": (4, 8),
              "attn_v": (4, 8), "attn_output": (8, 8), "ffn_gate": (16, 8), "ffn_up": (16, 8),
              "ffn_down": (8, 16)}
    hf = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 64),
                       (w.add_embedding_length, 8), (w.add_feed_forward_length, 16),
                       (w.add_head_count, 2), (w.add_head_count_kv, 1),
                       (w.add_rope_freq_base, 1e4), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_tokenizer_model, tokenizer_model), (w.add_tokenizer_pre, "smollm"),
                       (w.add_token_list, TINY_TOKENS), (w.add_token_types, [3, 3, 3, 1, 1, 1, 1, 1]),
                       (w.add_token_merges, ["a b", "Ġ ab"]), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2), (w.add_add_bos_token, add_bos)]:
        add(value)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 8)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    if with_output:
        w.add_tensor("output.weight", rng.standard_normal((8, 8)).astype(np.float32))
    heads = {"attn_q": 2, "attn_k": 1}
    for k, v in hf.items():
        w.add_tensor(f"blk.0.{k}.weight", hf_to_gguf_rows(v, heads[k]) if k in heads else v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_tiny_unpermute_recovers_hf_rows_and_separate_head(tmp_path: Path) -> None:
    hf = _tiny_gguf(tmp_path / "t.gguf")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("model.layers.0.self_attn.q_proj.weight"), hf["attn_q"])
        np.testing.assert_array_equal(f.get_tensor("model.layers.0.self_attn.k_proj.weight"), hf["attn_k"])
        assert "lm_head.weight" in f.keys()
    assert _json(out / "config.json")["tie_word_embeddings"] is False
    assert (out / "predict_t.yaml").is_file()


def test_add_bos_token_true_adds_bos(tmp_path: Path) -> None:
    _tiny_gguf(tmp_path / "t.gguf", add_bos=True)
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    raw = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))  # its own post-processor
    assert raw.encode("ab ab").ids == [1, 5, 7]
    tok = Tokenizer.from_model_dir(out)
    assert tok.encode("ab ab") == [1, 5, 7]
    assert tok.encode("<|im_start|>ab") == [1, 5]  # BOS not doubled


def test_unsupported_tokenizer_model_is_named(tmp_path: Path) -> None:
    _tiny_gguf(tmp_path / "t.gguf", tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'llama'"):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["t.gguf"]  # temp dir cleaned up


def test_changed_gguf_is_reconverted(tmp_path: Path) -> None:
    _tiny_gguf(tmp_path / "t.gguf", seed=0)
    convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    hf = _tiny_gguf(tmp_path / "t.gguf", seed=1)
    convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    with safe_open(tmp_path / "m" / "model.safetensors", framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("model.layers.0.mlp.up_proj.weight"), hf["ffn_up"])


def test_refuses_to_replace_foreign_directory(tmp_path: Path) -> None:
    _tiny_gguf(tmp_path / "t.gguf")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a mindserve GGUF conversion"):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"
