"""Weights: HF <-> MindFormers names, safetensors and MindSpore .ckpt round trips, and a ckpt-backed Engine."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from backends.mindspore.families import load_model
from backends.mindspore.modeldir.weights import (WeightsError, hf_to_mindformers, load_ckpt, load_safetensors,
                                                 load_weights, mindformers_to_hf, save_ckpt)
from tests.support.paths import REPO

# Every HF name pattern and its MindFormers (legacy Llama) name.
NAMES = [
    ("model.embed_tokens.weight", "model.tok_embeddings.embedding_weight"),
    ("model.norm.weight", "model.norm_out.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.attention.wq.weight"),
    ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.attention.wk.weight"),
    ("model.layers.2.self_attn.v_proj.weight", "model.layers.2.attention.wv.weight"),
    ("model.layers.3.self_attn.o_proj.weight", "model.layers.3.attention.wo.weight"),
    ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.attention.wq.bias"),
    ("model.layers.10.self_attn.k_proj.bias", "model.layers.10.attention.wk.bias"),
    ("model.layers.27.self_attn.v_proj.bias", "model.layers.27.attention.wv.bias"),
    ("model.layers.4.mlp.gate_proj.weight", "model.layers.4.feed_forward.w1.weight"),
    ("model.layers.5.mlp.down_proj.weight", "model.layers.5.feed_forward.w2.weight"),
    ("model.layers.6.mlp.up_proj.weight", "model.layers.6.feed_forward.w3.weight"),
    ("model.layers.7.input_layernorm.weight", "model.layers.7.attention_norm.weight"),
    ("model.layers.31.post_attention_layernorm.weight", "model.layers.31.ffn_norm.weight"),
]


@pytest.mark.parametrize("hf, mf", NAMES, ids=[hf for hf, _ in NAMES])
def test_name_mapping_round_trip(hf, mf):
    assert hf_to_mindformers(hf) == mf
    assert mindformers_to_hf(mf) == hf
    assert mindformers_to_hf(hf_to_mindformers(hf)) == hf


@pytest.mark.parametrize("convert, name", [
    (hf_to_mindformers, "model.layers.0.mlp.gate_proj.bias"),
    (hf_to_mindformers, "model.layers.0.input_layernorm.bias"),
    (hf_to_mindformers, "model.layers.x.self_attn.q_proj.weight"),
    (hf_to_mindformers, "model.layers.-1.self_attn.q_proj.weight"),
    (hf_to_mindformers, "model.layers.0.self_attn.q_proj.scales"),
    (hf_to_mindformers, "model.embed_tokens.weight.extra"),
    (hf_to_mindformers, "prefix.model.norm.weight"),
    (hf_to_mindformers, "transformer.wte.weight"),
    (hf_to_mindformers, "model.tok_embeddings.embedding_weight"),  # a MindFormers name, wrong direction
    (hf_to_mindformers, ""),
    (mindformers_to_hf, "model.embed_tokens.weight"),  # an HF name, wrong direction
    (mindformers_to_hf, "model.layers.0.self_attn.q_proj.weight"),
    (mindformers_to_hf, "model.layers.0.attention.w_qkv.weight"),  # fused layout: not supported
    (mindformers_to_hf, "model.layers.0.feed_forward.w1.bias"),
    (mindformers_to_hf, "model.tok_embeddings.weight"),
    (mindformers_to_hf, "adam_m.model.norm_out.weight"),
])
def test_unknown_names_raise(convert, name):
    with pytest.raises(WeightsError, match="unknown parameter name"):
        convert(name)


def test_every_tiny_qwen2_name_maps(tiny_qwen2_dir):
    names = set(load_safetensors(tiny_qwen2_dir / "model.safetensors"))
    assert {mindformers_to_hf(hf_to_mindformers(n)) for n in names} == names
    assert len({hf_to_mindformers(n) for n in names}) == len(names)  # no two HF names collide


# --- real files ---

def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == np.float32, name
        assert got[name].shape == array.shape, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_safetensors_to_ckpt_round_trip(tiny_qwen2_dir, tmp_path):
    weights = load_safetensors(tiny_qwen2_dir / "model.safetensors")
    assert "lm_head.weight" in weights and "model.layers.1.self_attn.v_proj.bias" in weights
    path = tmp_path / "model.ckpt"
    save_ckpt(weights, path)
    on_disk = ms.load_checkpoint(str(path))
    assert set(on_disk) == {hf_to_mindformers(n) for n in weights}  # stored under MindFormers names
    _assert_same(load_ckpt(path), weights)
    _assert_same(load_weights(path, "ckpt"), weights)


# Values exactly representable in float16 and bfloat16, so the widened float32 must match exactly.
EXACT = np.array([[0.5, -1.25, 3.0], [2.0 ** -6, 96.0, -0.0]], np.float32)


def test_ckpt_written_like_mindformers_loads_with_hf_names(tmp_path):
    """A checkpoint as MindFormers saves it: its own names, mixed dtypes, plus optimizer/training state."""
    entries = [
        ("model.tok_embeddings.embedding_weight", EXACT, ms.float32),
        ("model.layers.0.attention.wq.weight", EXACT, ms.float16),
        ("model.layers.0.attention.wq.bias", EXACT[0], ms.bfloat16),
        ("model.layers.0.feed_forward.w2.weight", EXACT * 2, ms.bfloat16),
        ("model.layers.0.ffn_norm.weight", EXACT[1], ms.float32),
        ("model.norm_out.weight", EXACT[0] + 1, ms.float16),
        ("lm_head.weight", -EXACT, ms.float32),
        ("adam_m.model.norm_out.weight", EXACT[0], ms.float32),
        ("adam_v.model.norm_out.weight", EXACT[0], ms.float32),
        ("global_step", np.array([7], np.int32), ms.int32),
        ("learning_rate", np.array([1e-4], np.float32), ms.float32),
        ("scale_sense", np.array([1024.0], np.float32), ms.float32),
    ]
    path = tmp_path / "mindformers.ckpt"
    # dtype= converts on the host; an .astype() would run a kernel, after which MindSpore refuses the
    # Engine's set_device() in this process.
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(a, dtype=t)} for n, a, t in entries], str(path))
    want = {mindformers_to_hf(n): a for n, a, _ in entries[:7]}
    assert "model.layers.0.self_attn.q_proj.bias" in want and "model.layers.0.mlp.down_proj.weight" in want
    _assert_same(load_ckpt(path), want)


def _write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors by hand (NumPy cannot write BF16): 8-byte header size, JSON header, then the data."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        blob = (np.ascontiguousarray(array, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


BF16_WANT = {"model.norm.weight": EXACT[0], "lm_head.weight": EXACT}


def test_bf16_safetensors_load_as_float32(tmp_path):
    """HF checkpoints mostly ship bfloat16 (here NumPy knows it: importing MindSpore registers the dtype)."""
    _write_bf16_safetensors(tmp_path / "model.safetensors", BF16_WANT)
    _assert_same(load_safetensors(tmp_path / "model.safetensors"), BF16_WANT)


def test_bf16_safetensors_load_before_mindspore_is_imported(tmp_path):
    """A fresh process (e.g. a conversion tool) that has not imported MindSpore, and does not for this: plain NumPy has
    no bfloat16, its bits are widened to float32 by hand."""
    _write_bf16_safetensors(tmp_path / "model.safetensors", BF16_WANT)
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from backends.mindspore.modeldir.weights import load_safetensors\n"
        "assert 'mindspore' not in sys.modules\n"
        "w = load_safetensors(Path(sys.argv[1]))\n"
        "assert 'mindspore' not in sys.modules  # widened in NumPy, not read by MindSpore (seconds of import)\n"
        "print(json.dumps({k: [str(v.dtype), v.tolist()] for k, v in w.items()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.safetensors")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {k: ["float32", v.tolist()] for k, v in BF16_WANT.items()}


def test_sharded_safetensors_dir_merges(tiny_qwen2_dir, tmp_path):
    weights = load_safetensors(tiny_qwen2_dir / "model.safetensors")
    names = sorted(weights)
    half = len(names) // 2
    save_file({n: weights[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: weights[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    _assert_same(load_weights(tmp_path, "safetensors"), weights)
    _assert_same(load_weights(tiny_qwen2_dir / "model.safetensors", "safetensors"), weights)


@pytest.mark.parametrize("case", ["missing-safetensors", "garbage-safetensors", "empty-dir", "missing-ckpt",
                                  "garbage-ckpt", "ckpt-is-dir", "ckpt-unknown-name"])
def test_weight_errors(tmp_path, case):
    target = tmp_path / "w"
    if case == "garbage-safetensors":
        target.write_bytes(b"not a safetensors file at all")
    elif case in ("empty-dir", "ckpt-is-dir"):
        target.mkdir()
    elif case == "garbage-ckpt":
        target.write_bytes(b"\x00garbage" * 10)
    elif case == "ckpt-unknown-name":
        ms.save_checkpoint([{"name": "model.layers.0.attention.w_qkv.weight", "data": ms.Tensor(EXACT)}],
                           str(target))
    with pytest.raises(WeightsError) as err:
        load_weights(target, "ckpt" if "ckpt" in case else "safetensors")
    assert str(target) in str(err.value)


def test_safetensors_are_read_through_a_memory_map_of_the_file(tmp_path):
    """Every dtype the converter writes comes back with its values (float16 as float32), each tensor a read-only view
    of the file, not a copy; a header that does not match its data is refused naming the file and the tensor."""
    path = tmp_path / "model.safetensors"
    rng = np.random.default_rng(0)
    want = {"a": rng.standard_normal((3, 5)).astype(np.float32), "h": rng.standard_normal(7).astype(np.float16),
            "blocks": rng.integers(0, 256, (4, 34), dtype=np.uint8), "empty": np.zeros((0, 3), np.float32)}
    save_file(want, str(path))
    got = load_safetensors(path)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value.astype(np.float32) if name == "h" else value)
    assert isinstance(got["a"].base, np.memmap) or isinstance(got["a"], np.memmap)
    assert not got["a"].flags.writeable
    raw = bytearray(path.read_bytes())
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    header["a"]["shape"] = [3, 6]  # 18 floats claimed in 15 floats' bytes
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    path.write_bytes(raw[:8] + text + raw[8 + size:])
    with pytest.raises(WeightsError, match=r"not a safetensors file: a: data_offsets .* do not hold F32 \(3, 6\)"):
        load_safetensors(path)


# --- a model directory whose yaml points at a .ckpt ---

def _ckpt_variant(src: Path, dst: Path) -> Path:
    """Copy a model dir, write its weights as model.ckpt, drop the safetensors and point the yaml at the ckpt."""
    shutil.copytree(src, dst)
    save_ckpt(load_safetensors(dst / "model.safetensors"), dst / "model.ckpt")
    (dst / "model.safetensors").unlink()
    yaml_path = dst / "predict_tiny.yaml"
    tree = yaml.safe_load(yaml_path.read_text(encoding="utf-8"))
    tree.update(load_checkpoint="model.ckpt", load_ckpt_format="ckpt")
    yaml_path.write_text(yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
    return dst


def test_ckpt_model_dir_generates_like_safetensors(tiny_qwen2_dir, tmp_path):
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig
    from backends.types import RequestParams

    config = EngineConfig(max_seq_len=64, max_input_tokens=32, max_batch_size=1, block_size=16,
                          prefill_chunk=16, window_buckets=(64,), batch_buckets=(1,))
    params = RequestParams(max_new_tokens=8, do_sample=False)
    prompt = "Hello! How are you today?"
    ckpt_dir = _ckpt_variant(tiny_qwen2_dir, tmp_path / "tiny_qwen2_ckpt")
    spec = load_model(ckpt_dir)
    assert (spec.checkpoint, spec.checkpoint_format) == (ckpt_dir / "model.ckpt", "ckpt")

    results = {}
    for name, model_dir in (("safetensors", tiny_qwen2_dir), ("ckpt", ckpt_dir)):
        with Engine(model_dir, config, warmup=False) as engine:  # compile only the graphs this request needs
            result = engine.generate(prompt, params)
        results[name] = [t.id for t in result.tokens]
    assert len(results["safetensors"]) > 0
    assert results["ckpt"] == results["safetensors"]
