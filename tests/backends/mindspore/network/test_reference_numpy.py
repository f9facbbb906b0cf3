"""Self-checks of the NumPy reference (invariants that catch real bugs), the tiny-model factory,
and the real-model golden: SmolLM2-135M greedy ids equal HF transformers fp32's."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer

from tests.support.scripts.make_goldens import GOLDEN, PUBLISHED_HF_FP32_IDS, render
from tests.support.reference_numpy import (
    RefConfig,
    RefModel,
    apply_rope,
    rope_tables,
    unpermute_gguf_rows,
)
from tests.support.hf_to_gguf import write_gguf
from tests.support.tiny_model import make_tiny_model

PROMPT = [5, 60, 7, 200, 33, 101, 250, 3, 77, 140]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> RefModel:
    return RefModel.from_dir(tiny_model_dir)


# ---------------------------------------------------------------- forward invariants


def test_causal_prefix_logits_ignore_later_tokens(tiny):
    cut = 6
    changed = PROMPT[:cut] + [9, 180, 44, 300]
    a, b = tiny.logits(PROMPT), tiny.logits(changed)
    np.testing.assert_allclose(a[:cut], b[:cut], rtol=0, atol=1e-12)
    assert np.abs(a[cut:] - b[cut:]).max() > 1e-3


def test_greedy_appends_argmax_of_full_recompute(tiny):
    out = tiny.greedy(PROMPT, 3)
    for step, token in enumerate(out):
        assert token == int(np.argmax(tiny.logits(PROMPT + out[:step])[-1]))


def test_float32_path_agrees_with_float64(tiny_model_dir, tiny):
    lo = RefModel.from_dir(tiny_model_dir, dtype=np.float32).logits(PROMPT)
    assert lo.dtype == np.float32
    np.testing.assert_allclose(lo, tiny.logits(PROMPT), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shift", [0, 1, 7, 300])
def test_rope_scores_depend_only_on_position_difference(shift):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 16))
    cos, sin = rope_tables(np.arange(400), 16, 10000.0)

    def rotated(x: np.ndarray, pos: int) -> np.ndarray:
        return apply_rope(x, cos[pos : pos + 1], sin[pos : pos + 1]).ravel()

    def score(m: int, n: int) -> float:
        return float(rotated(q, m) @ rotated(k, n))

    assert score(5 + shift, 2 + shift) == pytest.approx(score(5, 2), abs=1e-12)
    assert score(5, 2) != pytest.approx(score(6, 2), abs=1e-6)


def test_rope_is_hf_rotate_half_layout():
    """Column i and column i + hd/2 form one complex number rotated by pos * theta^(-2i/hd)."""
    hd, pos, theta = 16, 11, 500.0
    x = np.random.default_rng(1).standard_normal((1, 1, hd))
    cos, sin = rope_tables(np.array([pos]), hd, theta)
    got = apply_rope(x, cos, sin).ravel()
    z = (x.ravel()[: hd // 2] + 1j * x.ravel()[hd // 2 :]) * np.exp(1j * pos * theta ** (-np.arange(0, hd, 2) / hd))
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag]), atol=1e-12)


def test_gqa_equals_mha_with_duplicated_kv_heads(tiny):
    """HF repeat_kv: query head h reads kv head h // (H / KV). Expanding K/V rows into full MHA must not
    change anything."""
    cfg = tiny.config
    group, hd = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    rows = np.concatenate([np.arange(hd) + (h // group) * hd for h in range(cfg.num_heads)])
    weights = {n: w for n, w in tiny.w.items() if n != "lm_head.weight"}
    for name in list(weights):
        if ".k_proj." in name or ".v_proj." in name:
            weights[name] = weights[name][rows]
    mha = RefModel(RefConfig(**{**asdict(cfg), "num_kv_heads": cfg.num_heads}), weights)
    np.testing.assert_allclose(mha.logits(PROMPT), tiny.logits(PROMPT), rtol=0, atol=1e-12)


def test_qwen2_biases_are_applied(tiny_qwen2_dir):
    model = RefModel.from_dir(tiny_qwen2_dir)
    biases = [n for n in model.w if n.endswith(".bias")]
    assert len(biases) == 3 * model.config.num_layers
    assert all(".o_proj." not in n for n in biases)
    no_bias = RefModel(replace(model.config, qkv_bias=False), {n: w for n, w in model.w.items() if "bias" not in n})
    assert np.abs(no_bias.logits(PROMPT) - model.logits(PROMPT)).max() > 1e-2


def test_untied_head_is_the_separate_lm_head(tiny_qwen2_dir):
    model = RefModel.from_dir(tiny_qwen2_dir)
    assert not model.config.tie_word_embeddings
    assert not np.array_equal(model.w["lm_head.weight"], model.w["model.embed_tokens.weight"])
    np.testing.assert_allclose(
        model.logits(PROMPT), model.hidden_states(PROMPT) @ model.w["lm_head.weight"].T, atol=1e-12
    )


def test_missing_qkv_bias_is_refused(tiny_qwen2_dir):
    model = RefModel.from_dir(tiny_qwen2_dir)
    with pytest.raises(ValueError, match="q_proj.bias"):
        RefModel(model.config, {n: w for n, w in model.w.items() if not n.endswith("q_proj.bias")})


def test_unsupported_rope_scaling_is_refused():
    cfg = {"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "vocab_size": 4, "rms_norm_eps": 1e-6, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(NotImplementedError):
        RefConfig.from_hf(cfg)


# ---------------------------------------------------------------- GGUF path


def _permute_like_llamacpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """GGUF row h*hd + 2i + s holds HF row h*hd + s*hd/2 + i (written from the definition, by index)."""
    hd = w.shape[0] // n_heads
    src = [h * hd + s * (hd // 2) + i for h in range(n_heads) for i in range(hd // 2) for s in range(2)]
    return w[src]


def _interleaved_rope(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """llama.cpp's normal (non-NEOX) rotary: pairs (2i, 2i+1). x: [hd]."""
    hd = x.shape[0]
    ang = pos * theta ** (-np.arange(0, hd, 2) / hd)
    even, odd = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2] = even * np.cos(ang) - odd * np.sin(ang)
    out[1::2] = even * np.sin(ang) + odd * np.cos(ang)
    return out


def test_unpermute_inverts_the_gguf_layout_and_maps_interleaved_rope_to_rotate_half():
    n_heads, hd, pos, theta = 3, 8, 13, 100000.0
    rng = np.random.default_rng(2)
    w = rng.standard_normal((n_heads * hd, 5))
    np.testing.assert_array_equal(unpermute_gguf_rows(_permute_like_llamacpp(w, n_heads), n_heads), w)
    bias = rng.standard_normal(n_heads * hd)
    np.testing.assert_array_equal(unpermute_gguf_rows(_permute_like_llamacpp(bias, n_heads), n_heads), bias)
    # What llama.cpp computes on the permuted rows is the permuted HF rotate_half result.
    q = rng.standard_normal(n_heads * hd)
    cos, sin = rope_tables(np.array([pos]), hd, theta)
    hf = apply_rope(q.reshape(n_heads, 1, hd), cos, sin).reshape(-1)
    gg = _permute_like_llamacpp(q, n_heads).reshape(n_heads, hd)
    gg = np.concatenate([_interleaved_rope(head, pos, theta) for head in gg])
    np.testing.assert_allclose(gg, _permute_like_llamacpp(hf, n_heads), atol=1e-12)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_from_gguf_equals_from_dir(fixture, request, tmp_path):
    """The checkpoint as llama.cpp lays it out (tests/support/hf_to_gguf.py; Llama's Q/K rows permuted)."""
    model_dir = request.getfixturevalue(fixture)
    write_gguf(model_dir, tmp_path / "tiny.gguf", json.loads((model_dir / "config.json").read_text())["model_type"])
    direct = RefModel.from_dir(model_dir)
    via_gguf = RefModel.from_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    # GGUF stores eps as float32, hence approx; everything else must be equal.
    assert via_gguf.config.rms_norm_eps == pytest.approx(direct.config.rms_norm_eps, rel=1e-7)
    assert asdict(via_gguf.config) | {"rms_norm_eps": 0} == asdict(direct.config) | {"rms_norm_eps": 0}
    np.testing.assert_allclose(via_gguf.logits(PROMPT), direct.logits(PROMPT), rtol=0, atol=1e-10)
    cached = RefModel.from_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")  # second read: npz
    assert len(list((tmp_path / "cache").iterdir())) == 1
    np.testing.assert_array_equal(cached.logits(PROMPT), via_gguf.logits(PROMPT))


# ---------------------------------------------------------------- tiny-model factory


def test_tiny_model_is_byte_identical_for_a_seed(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    c = make_tiny_model(tmp_path / "c", seed=4)
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("fixture, bias, tie", [("tiny_model_dir", False, True), ("tiny_qwen2_dir", True, False)])
def test_tiny_model_files_agree(fixture, bias, tie, request):
    d = request.getfixturevalue(fixture)
    cfg = json.loads((d / "config.json").read_text())
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    mc = yaml.safe_load((d / "predict_tiny.yaml").read_text())["model"]["model_config"]
    assert cfg["vocab_size"] == tok.get_vocab_size() == mc["vocab_size"] == 384
    assert (cfg["eos_token_id"], mc["eos_token_id"]) == (tok.token_to_id("<|im_end|>"),) * 2
    assert (cfg["bos_token_id"], cfg["pad_token_id"]) == (mc["bos_token_id"], mc["pad_token_id"])
    assert (mc["qkv_has_bias"], mc["tie_word_embeddings"], cfg["tie_word_embeddings"]) == (bias, tie, tie)
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["add_bos_token"] is False
    assert all(t["special"] for t in tcfg["added_tokens_decoder"].values())
    text = "<|im_start|>user\nHello, 2024 café!<|im_end|>\n"
    ids = tok.encode(text).ids
    assert tok.token_to_id("<|im_start|>") == ids[0] and tok.decode(ids, skip_special_tokens=False) == text
    RefModel.from_dir(d)  # shapes and names check out


# ---------------------------------------------------------------- real model golden


def test_smollm2_greedy_matches_hf_fp32(default_gguf_path):
    """~5 s with the npz cache next to the GGUF (~10 s cold). Index 1 wins by only 0.017 logits, so a
    wrong detail anywhere (eps, theta, un-permutation, head tying) flips it."""
    golden = json.loads(GOLDEN.read_text())
    assert render(golden) == GOLDEN.read_text(), "golden file is not in make_goldens' format"
    assert golden["generated_ids"] == PUBLISHED_HF_FP32_IDS
    model = RefModel.from_gguf(default_gguf_path, cache_dir=default_gguf_path.parent / "reference_numpy")
    assert model.greedy(golden["prompt_ids"], len(golden["generated_ids"])) == golden["generated_ids"]
