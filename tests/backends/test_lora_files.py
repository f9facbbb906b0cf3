"""LoRA adapter directories (backends/lora.py, lora_config.py, safetensors_reader.py): valid PEFT adapters load
with the right shapes and scales; every rule has a failing case whose message names the adapter, the file and
the key or tensor; hostile safetensors files are refused before any data is read (tracemalloc peak)."""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors import deserialize
from safetensors.numpy import save_file

from backends.lora import PROJECTIONS, AdapterError, BaseDims, LoraAdapter, load_adapter
from tests.support.lora_adapters import make_adapter, merged_weights

NAME = "ad-1"
DIMS = BaseDims(num_layers=3, hidden=16, q_out=16, kv_out=8, intermediate=24)
SMOLLM2 = BaseDims(num_layers=30, hidden=576, q_out=576, kv_out=192, intermediate=1536)
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
DROP = object()  # _edit: remove the key


def _adapter(tmp_path: Path, **kwargs) -> Path:
    kwargs.setdefault("seed", 3)
    return make_adapter(tmp_path / "adapter", kwargs.pop("dims", DIMS), **kwargs)


def _edit(path: Path, **changes) -> Path:
    config = json.loads((path / CONFIG).read_text())
    for key, value in changes.items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (path / CONFIG).write_text(json.dumps(config))
    return path


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """The adapter's tensors read by the safetensors library (float32 files only)."""
    return {k: np.frombuffer(bytes(v["data"]), "<f4").reshape(v["shape"]).copy()
            for k, v in deserialize((path / WEIGHTS).read_bytes())}


def _rewrite(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    return path


def _refused(path: Path | str, file: str, *words: str, dims: BaseDims = DIMS,
             max_rank: int | None = None) -> AdapterError:
    with pytest.raises(AdapterError) as info:
        load_adapter(NAME, path, dims, max_rank)
    message = str(info.value)
    for word in (repr(NAME), file, *words):
        assert word in message, f"{word!r} not in {message!r}"
    return info.value


# ---------------------------------------------------------------- the base model's shapes


def test_base_dims_of_a_model_spec_and_projection_shapes():
    spec = SimpleNamespace(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                           intermediate_size=1536)
    dims = BaseDims.of(spec)
    assert dims == SMOLLM2
    # (in_features, out_features): the table in reference/lora-and-multimodal.md §4 (A is r x in, B out x r)
    assert [dims.shape(p) for p in PROJECTIONS] == [(576, 576), (576, 192), (576, 192), (576, 576),
                                                     (576, 1536), (576, 1536), (1536, 576)]


# ---------------------------------------------------------------- valid adapters


def test_all_seven_projections_load_with_their_shapes_and_scale(tmp_path):
    path = _adapter(tmp_path, rank=8, alpha=16)
    adapter = load_adapter(NAME, path, DIMS)
    assert isinstance(adapter, LoraAdapter)
    assert (adapter.name, adapter.path, adapter.rank, adapter.scale, adapter.use_rslora) == (NAME, path, 8, 2.0, False)
    assert adapter.targets == PROJECTIONS
    assert sorted(adapter.modules) == sorted((i, p) for i in range(3) for p in PROJECTIONS)
    on_disk = _tensors(path)
    for (layer, proj), module in adapter.modules.items():
        in_features, out_features = DIMS.shape(proj)
        assert module.a.shape == (8, in_features) and module.b.shape == (out_features, 8)
        assert module.a.dtype == module.b.dtype == np.float32
        assert module.a.flags.c_contiguous and module.b.flags.c_contiguous
        assert module.scale == 2.0
        block = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
        np.testing.assert_array_equal(module.a, on_disk[f"{PREFIX}.{layer}.{block}.{proj}.lora_A.weight"])
        np.testing.assert_array_equal(module.b, on_disk[f"{PREFIX}.{layer}.{block}.{proj}.lora_B.weight"])
        assert np.abs(module.b).max() > 0  # the helper's B is not PEFT's zero init
    assert adapter.info() == {"name": NAME, "rank": 8, "targets": list(PROJECTIONS), "scale": 2.0,
                              "use_rslora": False}
    json.dumps(adapter.info())


def test_factors_are_read_only(tmp_path):
    module = load_adapter(NAME, _adapter(tmp_path), DIMS).modules[(0, "q_proj")]
    with pytest.raises(ValueError):
        module.a[0, 0] = 1.0


def test_q_and_v_only(tmp_path):
    adapter = load_adapter(NAME, _adapter(tmp_path, targets=("v_proj", "q_proj"), rank=4, alpha=4), DIMS)
    assert adapter.targets == ("q_proj", "v_proj")
    assert sorted(adapter.modules) == sorted((i, p) for i in range(3) for p in ("q_proj", "v_proj"))
    assert adapter.scale == 1.0


def test_rslora_scale_is_alpha_over_sqrt_r(tmp_path):
    adapter = load_adapter(NAME, _adapter(tmp_path, rank=16, alpha=8, use_rslora=True), DIMS)
    assert adapter.use_rslora and adapter.scale == pytest.approx(8 / math.sqrt(16)) == 2.0
    assert all(m.scale == 2.0 for m in adapter.modules.values())


def test_rank_and_alpha_patterns_match_the_end_of_the_module_name_as_peft_does(tmp_path):
    dims = BaseDims(num_layers=12, hidden=16, q_out=16, kv_out=8, intermediate=24)
    path = _adapter(tmp_path, dims=dims, rank=8, alpha=16,
                    rank_pattern={"1.self_attn.q_proj": 2, "v_proj": 4, r"layers\.[23]\.mlp\.up_proj": 6},
                    alpha_pattern={"down_proj": 4, "proj": 1000})  # "proj" never matches: no dot before it
    adapter = load_adapter(NAME, path, dims)
    ranks = {k: m.a.shape[0] for k, m in adapter.modules.items()}
    scales = {k: m.scale for k, m in adapter.modules.items()}
    assert ranks[(1, "q_proj")] == 2 and scales[(1, "q_proj")] == 16 / 2
    assert ranks[(11, "q_proj")] == 8  # "1.self_attn.q_proj" needs a dot before the 1
    assert all(ranks[(i, "v_proj")] == 4 and scales[(i, "v_proj")] == 16 / 4 for i in range(12))
    assert ranks[(2, "up_proj")] == ranks[(3, "up_proj")] == 6 and ranks[(4, "up_proj")] == 8
    assert all(scales[(i, "down_proj")] == 4 / 8 for i in range(12))
    assert scales[(0, "k_proj")] == 2.0
    assert adapter.rank == 8 and adapter.scale == 2.0


def test_patterns_with_rslora_and_the_first_matching_key_wins(tmp_path):
    path = _adapter(tmp_path, rank=16, alpha=8, use_rslora=True,
                    rank_pattern={"layers.0.self_attn.q_proj": 4, "q_proj": 9},
                    alpha_pattern={"q_proj": 3})
    adapter = load_adapter(NAME, path, DIMS, max_rank=16)
    assert adapter.modules[(0, "q_proj")].a.shape == (4, 16)
    assert adapter.modules[(1, "q_proj")].a.shape == (9, 16)
    assert adapter.modules[(0, "q_proj")].scale == pytest.approx(3 / 2)
    assert adapter.modules[(1, "q_proj")].scale == pytest.approx(3 / 3)
    assert adapter.modules[(0, "o_proj")].scale == pytest.approx(8 / 4)
    assert adapter.rank == 16


@pytest.mark.parametrize("dtype, tolerance", [("float16", 1e-3), ("bfloat16", 8e-3)])
def test_half_precision_files_load_as_float32(tmp_path, dtype, tolerance):
    reference = load_adapter(NAME, _adapter(tmp_path / "f32", seed=5), DIMS)
    adapter = load_adapter(NAME, _adapter(tmp_path / dtype, seed=5, dtype=dtype), DIMS)
    for key, module in adapter.modules.items():
        assert module.a.dtype == np.float32 and module.a.flags.c_contiguous
        for got, want in ((module.a, reference.modules[key].a), (module.b, reference.modules[key].b)):
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=1e-6)
            assert not np.array_equal(got, want)  # really stored in half precision


def test_bf16_decodes_exactly(tmp_path):
    values = np.array([[1.0, -2.5, 0.15625, 3.0e38], [1e-38, -0.0, 65504.0, 7.0]], np.float32)
    bits = (values.view(np.uint32) >> 16).astype("<u2")  # these values are exact in bfloat16 after truncation
    path = _adapter(tmp_path, targets=("q_proj",), rank=2, dims=BaseDims(1, 4, 4, 4, 4))
    raw = _safetensors_bytes({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": ("BF16", [2, 4], bits.tobytes()),
                              f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": ("BF16", [4, 2], bits.tobytes())})
    (path / WEIGHTS).write_bytes(raw)
    module = load_adapter(NAME, path, BaseDims(1, 4, 4, 4, 4)).modules[(0, "q_proj")]
    np.testing.assert_array_equal(module.a, (bits.astype(np.uint32) << 16).view(np.float32))


def test_layers_to_transform_is_honoured(tmp_path):
    path = _adapter(tmp_path, layers=[0, 2], targets=("q_proj", "down_proj"))
    adapter = load_adapter(NAME, path, DIMS)
    assert list(adapter.modules) == [(0, "q_proj"), (0, "down_proj"), (2, "q_proj"), (2, "down_proj")]
    path = _edit(_adapter(tmp_path / "int", layers=[2], targets=("down_proj",)), layers_to_transform=2,
                 layers_pattern="layers")  # an int and PEFT's layers_pattern
    assert list(load_adapter(NAME, path, DIMS).modules) == [(2, "down_proj")]


def test_layers_pattern_that_names_no_layer_selects_nothing(tmp_path):
    path = _edit(_adapter(tmp_path, layers=[0]), layers_pattern="h")
    _refused(path, CONFIG, "target_modules", "selects no module")


def test_target_modules_as_a_regex_all_linear_and_exclude_modules(tmp_path):
    path = _adapter(tmp_path, targets=("q_proj", "v_proj"))
    assert load_adapter(NAME, _edit(path, target_modules=r".*\.(q|v)_proj"), DIMS).targets == ("q_proj", "v_proj")
    _edit(path, target_modules=r"model\.layers\.[01]\.self_attn\.(q|v)_proj")
    _refused(path, WEIGHTS, f"{PREFIX}.2.self_attn.q_proj.lora_A.weight", "does not target")
    path = _adapter(tmp_path / "all")
    assert load_adapter(NAME, _edit(path, target_modules="all-linear"), DIMS).targets == PROJECTIONS
    _edit(path, exclude_modules=["mlp.down_proj"])
    _refused(path, WEIGHTS, "down_proj.lora_A.weight", "does not target")
    path = _adapter(tmp_path / "excluded", targets=("q_proj", "k_proj"))
    assert load_adapter(NAME, _edit(path, target_modules=["q_proj", "k_proj", "v_proj"],
                                    exclude_modules=r".*v_proj"), DIMS).targets == ("q_proj", "k_proj")


def test_a_target_given_as_a_full_module_name(tmp_path):
    path = _adapter(tmp_path, targets=("q_proj",), layers=[1])
    adapter = load_adapter(NAME, _edit(path, target_modules=["model.layers.1.self_attn.q_proj"],
                                       layers_to_transform=None), DIMS)
    assert list(adapter.modules) == [(1, "q_proj")]


def test_default_adapter_name_in_tensor_names_is_accepted(tmp_path):
    path = _adapter(tmp_path, targets=("q_proj",))
    tensors = {k.replace(".lora_A.", ".lora_A.default."): v for k, v in _tensors(path).items()}
    adapter = load_adapter(NAME, _rewrite(path, tensors), DIMS)
    assert len(adapter.modules) == 3


def test_an_older_peft_config_loads(tmp_path):
    """adapter_config.json as PEFT 0.6 wrote it: fewer keys, everything else PEFT's defaults."""
    path = _adapter(tmp_path, targets=("q_proj", "v_proj"), rank=8, alpha=32)
    (path / CONFIG).write_text(json.dumps({
        "auto_mapping": None, "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "layers_pattern": None,
        "layers_to_transform": None, "lora_alpha": 32, "lora_dropout": 0.05, "modules_to_save": None,
        "peft_type": "LORA", "r": 8, "revision": None, "target_modules": ["v_proj", "q_proj"],
        "task_type": "CAUSAL_LM"}))
    assert load_adapter(NAME, path, DIMS).scale == 4.0


def test_smollm2_shaped_adapter_at_the_rank_limit(tmp_path):
    path = _adapter(tmp_path, dims=SMOLLM2, targets=("k_proj", "down_proj"), rank=8, alpha=8, layers=[29])
    adapter = load_adapter(NAME, path, SMOLLM2, max_rank=8)
    assert adapter.modules[(29, "k_proj")].b.shape == (192, 8)
    assert adapter.modules[(29, "down_proj")].a.shape == (8, 1536)


# ---------------------------------------------------------------- the test helper


def _base_weights(dims: BaseDims, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.standard_normal((32, dims.hidden)).astype(np.float32)}
    for i in range(dims.num_layers):
        for proj in PROJECTIONS:
            block = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            in_features, out_features = dims.shape(proj)
            out[f"model.layers.{i}.{block}.{proj}.weight"] = \
                (rng.standard_normal((out_features, in_features)) * 0.05 * (1 + i)).astype(np.float32)
        out[f"model.layers.{i}.input_layernorm.weight"] = np.ones(dims.hidden, np.float32)
    return out


@pytest.mark.parametrize("kwargs", [
    {},
    {"targets": ("q_proj", "v_proj"), "rank": 4, "alpha": 32},
    {"use_rslora": True, "rank": 16, "alpha": 4},
    {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"layers.1.mlp.up_proj": 3}, "use_rslora": True},
    {"dtype": "bfloat16", "layers": [1]},
    {"dtype": "float16"},
], ids=["all", "q-v", "rslora", "patterns", "bf16-layer1", "f16"])
def test_merged_weights_agree_with_the_loaded_factors(tmp_path, kwargs):
    base = _base_weights(DIMS)
    path = _adapter(tmp_path, base_weights=base, **kwargs)
    adapter = load_adapter(NAME, path, DIMS)
    merged = merged_weights(base, path)
    assert merged.keys() == base.keys()
    changed = {k for k in base if merged[k] is not base[k]}
    assert len(changed) == len(adapter.modules)
    for (layer, proj), module in adapter.modules.items():
        key = f"model.layers.{layer}.{'self_attn' if proj in PROJECTIONS[:4] else 'mlp'}.{proj}.weight"
        assert merged[key].dtype == np.float32 and merged[key].shape == base[key].shape
        delta = module.scale * module.b.astype(np.float64) @ module.a.astype(np.float64)
        np.testing.assert_allclose(merged[key] - base[key].astype(np.float64), delta, rtol=1e-5, atol=1e-6)


def test_helper_magnitudes_are_calibrated_to_the_base_weights(tmp_path):
    base = _base_weights(DIMS)
    for strength in (0.5, 2.0):
        path = _adapter(tmp_path / str(strength), base_weights=base, strength=strength, rank=8)
        for (layer, proj), module in load_adapter(NAME, path, DIMS).modules.items():
            key = f"model.layers.{layer}.{'self_attn' if proj in PROJECTIONS[:4] else 'mlp'}.{proj}.weight"
            ratio = np.std(module.scale * module.b @ module.a) / np.std(base[key])
            assert 0.4 * strength < ratio < 2.5 * strength, (key, ratio)


def test_helper_is_deterministic_per_seed(tmp_path):
    one, two = _adapter(tmp_path / "1", seed=9), _adapter(tmp_path / "2", seed=9)
    other = _adapter(tmp_path / "3", seed=10)
    assert (one / WEIGHTS).read_bytes() == (two / WEIGHTS).read_bytes()
    assert (one / CONFIG).read_bytes() == (two / CONFIG).read_bytes()
    assert (one / WEIGHTS).read_bytes() != (other / WEIGHTS).read_bytes()


# ---------------------------------------------------------------- the directory


def test_missing_directory_or_files(tmp_path):
    _refused(tmp_path / "nowhere", "nowhere", "does not exist")
    (tmp_path / "file").write_text("x")
    _refused(tmp_path / "file", "file", "not a directory")
    path = _adapter(tmp_path)
    (path / WEIGHTS).unlink()
    _refused(path, WEIGHTS, "missing")
    (path / CONFIG).unlink()
    _refused(path, CONFIG, "missing")


def test_a_pickle_bin_is_refused_with_the_conversion_hint(tmp_path):
    path = _adapter(tmp_path)
    (path / WEIGHTS).rename(path / "adapter_model.bin")
    error = _refused(path, "adapter_model.bin", "pickle", "convert", WEIGHTS)
    assert error.key == "adapter_model.bin"


# ---------------------------------------------------------------- adapter_config.json


def test_config_must_be_a_bounded_json_object(tmp_path):
    path = _adapter(tmp_path)
    (path / CONFIG).write_text("{not json")
    _refused(path, CONFIG, "not valid JSON")
    (path / CONFIG).write_text("[1, 2]")
    _refused(path, CONFIG, "JSON object")
    (path / CONFIG).write_bytes(b"\xff\xfe{}")
    _refused(path, CONFIG, "not valid JSON")
    (path / CONFIG).write_text("[" * 100_000 + "]" * 100_000)
    _refused(path, CONFIG, "not valid JSON", "nested deeper than 16 levels")
    (path / CONFIG).write_text(json.dumps({"peft_type": "LORA", "pad": " " * (1 << 20)}))
    _refused(path, CONFIG, "larger than 1048576 bytes")


@pytest.mark.parametrize("key, value, words", [
    ("peft_type", "PREFIX_TUNING", ["`peft_type`", "PREFIX_TUNING"]),
    ("peft_type", DROP, ["`peft_type`", "None"]),
    ("task_type", "SEQ_CLS", ["`task_type`", "SEQ_CLS"]),
    ("r", 0, ["`r`", "(0, 1024]", "got 0"]),
    ("r", -4, ["`r`", "got -4"]),
    ("r", 1025, ["`r`", "got 1025"]),
    ("r", 8.5, ["`r`", "an integer", "got 8.5"]),
    ("r", "8", ["`r`", "got '8'"]),
    ("r", True, ["`r`", "got True"]),
    ("r", DROP, ["`r`", "got None"]),
    ("lora_alpha", 0, ["`lora_alpha`", "got 0"]),
    ("lora_alpha", 1024.5, ["`lora_alpha`", "got 1024.5"]),
    ("lora_alpha", "16", ["`lora_alpha`", "got '16'"]),
    ("lora_alpha", float("nan"), ["`lora_alpha`", "got nan"]),
    ("lora_alpha", DROP, ["`lora_alpha`"]),
    ("rank_pattern", {"q_proj": 0}, ["rank_pattern['q_proj']", "got 0"]),
    ("rank_pattern", {"q_proj": 2048}, ["rank_pattern['q_proj']", "got 2048"]),
    ("rank_pattern", {"q_proj": 1.5}, ["rank_pattern['q_proj']", "an integer"]),
    ("rank_pattern", ["q_proj"], ["`rank_pattern`", "must be an object"]),
    ("rank_pattern", {"q_proj(": 2}, ["rank_pattern['q_proj(']", "not a valid regular expression"]),
    ("alpha_pattern", {"v_proj": 0}, ["alpha_pattern['v_proj']", "got 0"]),
    ("alpha_pattern", {"v_proj": 1e9}, ["alpha_pattern['v_proj']", "got 1000000000.0"]),
    ("alpha_pattern", {"v_proj": None}, ["alpha_pattern['v_proj']", "got None"]),
    ("use_rslora", "yes", ["`use_rslora`", "'yes'"]),
    ("use_dora", True, ["DoRA", "`use_dora`"]),
    ("fan_in_fan_out", True, ["`fan_in_fan_out`"]),
    ("modules_to_save", ["lm_head"], ["`modules_to_save`", "lm_head"]),
    ("bias", "all", ["`bias`", "'all'"]),
    ("bias", "lora_only", ["`bias`", "'lora_only'"]),
    ("lora_bias", True, ["`lora_bias`"]),
    ("target_parameters", ["mlp.experts.gate_up_proj"], ["`target_parameters`"]),
    ("trainable_token_indices", [1, 2], ["`trainable_token_indices`"]),
    ("layer_replication", [[0, 2]], ["`layer_replication`"]),
    ("use_qalora", True, ["`use_qalora`"]),
    ("alora_invocation_tokens", [5, 6], ["`alora_invocation_tokens`"]),
    ("use_bdlora", {"nblocks": 2}, ["`use_bdlora`"]),
    ("init_lora_weights", "pissa_niter_4", ["`init_lora_weights`", "pissa_niter_4", "base weights"]),
    ("init_lora_weights", "loftq", ["`init_lora_weights`", "loftq"]),
    ("target_modules", ["embed_tokens"], ["`target_modules`", "'embed_tokens'", "unsupported"]),
    ("target_modules", ["q_proj", "lm_head"], ["`target_modules`", "'lm_head'", "unsupported"]),
    ("target_modules", ["q_proj", "foo_proj"], ["`target_modules`", "'foo_proj'", "not a projection", "q_proj"]),
    ("target_modules", ["input_layernorm"], ["`target_modules`", "'input_layernorm'", "not a projection"]),
    ("target_modules", [], ["`target_modules`", "non-empty list"]),
    ("target_modules", DROP, ["`target_modules`", "got None"]),
    ("target_modules", 7, ["`target_modules`", "got 7"]),
    ("target_modules", [3], ["`target_modules`", "got [3]"]),
    ("target_modules", r".*lm_head", ["`target_modules`", "lm_head", "unsupported"]),
    ("target_modules", r".*\.embed_tokens", ["`target_modules`", "embed_tokens", "unsupported"]),
    ("target_modules", r".*norm", ["`target_modules`", "model.norm", "not a projection"]),
    ("target_modules", r".*layernorm", ["`target_modules`", "model.layers.0.input_layernorm", "not a projection"]),
    ("target_modules", r".*", ["`target_modules`", "model.embed_tokens", "unsupported"]),
    ("target_modules", r".*\.mlp", ["`target_modules`", "model.layers.0.mlp,", "not a projection"]),
    ("target_modules", r"nothing", ["`target_modules`", "selects no module"]),
    ("target_modules", r"(", ["`target_modules`", "not a valid regular expression"]),
    ("exclude_modules", "(", ["`exclude_modules`", "not a valid regular expression"]),
    ("exclude_modules", 5, ["`exclude_modules`", "got 5"]),
    ("exclude_modules", ["proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     ["`target_modules`", "selects no module"]),
    ("layers_to_transform", [0, 99], ["`layers_to_transform`", "[0, 3)", "[0, 99]"]),
    ("layers_to_transform", "0", ["`layers_to_transform`", "'0'"]),
    ("layers_pattern", "layers", ["`layers_pattern`", "needs `layers_to_transform`"]),
])
def test_config_rule_refused(tmp_path, key, value, words):
    path = _edit(_adapter(tmp_path), **{key: value})
    error = _refused(path, CONFIG, *words)
    assert error.key is not None and error.file.endswith(CONFIG)


def test_layers_to_transform_with_a_regex_target_is_refused_as_in_peft(tmp_path):
    path = _edit(_adapter(tmp_path, layers=[0]), target_modules=r".*q_proj")
    _refused(path, CONFIG, "`layers_to_transform`", "regular expression")


def test_rank_above_max_lora_rank_names_maxloraRank(tmp_path):
    path = _adapter(tmp_path, rank=8)
    _refused(path, CONFIG, "maxLoraRank 4", "rank 8", "`r`", max_rank=4)
    path = _adapter(tmp_path / "pattern", rank=4, rank_pattern={"o_proj": 16})
    error = _refused(path, CONFIG, "maxLoraRank 8", "rank 16", "rank_pattern['o_proj']", "o_proj", max_rank=8)
    assert error.key == "rank_pattern['o_proj']"


# ---------------------------------------------------------------- tensor names, shapes and values


def _q(layer: int = 0, factor: str = "A") -> str:
    return f"{PREFIX}.{layer}.self_attn.q_proj.lora_{factor}.weight"


@pytest.mark.parametrize("extra, words", [
    ("base_model.model.model.embed_tokens.weight", ["embed_tokens", "unsupported"]),
    ("base_model.model.lm_head.weight", ["lm_head", "unsupported"]),
    (f"{PREFIX}.0.self_attn.q_proj.lora_embedding_A", ["embedding", "unsupported"]),
    (f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", ["DoRA"]),
    (f"{PREFIX}.0.self_attn.q_proj.lora_B.bias", ["lora_bias"]),
    (f"{PREFIX}.0.self_attn.q_proj.lora_A.other.weight", ["not a LoRA factor"]),
    ("model.layers.0.self_attn.q_proj.lora_A.weight", ["not a LoRA factor"]),
    (f"{PREFIX}.00.self_attn.q_proj.lora_A.weight", ["not a LoRA factor"]),
    (f"{PREFIX}.0.self_attn.gate_proj.lora_A.weight", ["self_attn.gate_proj", "not a projection"]),
    (f"{PREFIX}.0.mlp.fc1.lora_A.weight", ["mlp.fc1", "not a projection"]),
    (f"{PREFIX}.3.self_attn.q_proj.lora_A.weight", ["layer 3", "3 layers"]),
    (f"{PREFIX}.0.self_attn.k_proj.lora_A.weight", ["model.layers.0.self_attn.k_proj", "does not target"]),
    (f"{PREFIX}.0.self_attn.q_proj.lora_A.default.weight", [f"repeats '{PREFIX}.0.self_attn.q_proj.lora_A"]),
])
def test_tensor_name_refused(tmp_path, extra, words):
    path = _adapter(tmp_path, targets=("q_proj",), rank=2)
    tensors = _tensors(path)
    tensors[extra] = tensors[_q()].copy()
    error = _refused(_rewrite(path, tensors), WEIGHTS, repr(extra), *words)
    assert error.key == extra or error.key == _q()


@pytest.mark.parametrize("missing", [_q(1, "A"), _q(2, "B")])
def test_a_targeted_module_needs_both_factors(tmp_path, missing):
    path = _adapter(tmp_path, targets=("q_proj",), rank=2)
    tensors = _tensors(path)
    del tensors[missing]
    error = _refused(_rewrite(path, tensors), WEIGHTS, repr(missing), "missing", "lora_A and lora_B")
    assert error.key == missing


@pytest.mark.parametrize("key, shape, words", [
    (_q(0, "A"), (3, 16), ["[3, 16]", "expected [2, 16]", "`r`"]),  # rank differs from the config's
    (_q(1, "B"), (8, 2), ["[8, 2]", "expected [16, 2]"]),  # out_features is not the base model's
    (_q(2, "A"), (2, 17), ["expected [2, 16]"]),
    (_q(0, "B"), (16, 2, 1), ["[16, 2, 1]", "expected [16, 2]"]),
    (_q(0, "A"), (32,), ["[32]"]),
])
def test_tensor_shape_refused(tmp_path, key, shape, words):
    path = _adapter(tmp_path, targets=("q_proj",), rank=2)
    tensors = _tensors(path)
    tensors[key] = np.ones(shape, np.float32)
    assert _refused(_rewrite(path, tensors), WEIGHTS, repr(key), *words).key == key


def test_shape_checked_against_the_pattern_rank(tmp_path):
    path = _adapter(tmp_path, targets=("q_proj",), rank=2)
    _edit(path, rank_pattern={"layers.1.self_attn.q_proj": 4})
    _refused(path, WEIGHTS, repr(_q(1, "A")), "expected [4, 16]", "rank_pattern['layers.1.self_attn.q_proj']")


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8, np.uint16])
def test_wrong_dtype_refused(tmp_path, dtype):
    path = _adapter(tmp_path, targets=("q_proj",), rank=2)
    tensors = _tensors(path)
    tensors[_q(1, "B")] = tensors[_q(1, "B")].astype(dtype)
    _refused(_rewrite(path, tensors), WEIGHTS, repr(_q(1, "B")), "dtype", "accepted: F32, F16, BF16")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_non_finite_values_refused(tmp_path, bad, dtype):
    path = _adapter(tmp_path, targets=("q_proj",), rank=2)
    tensors = {k: v.astype(dtype) for k, v in _tensors(path).items()}
    tensors[_q(2, "B")][5, 1] = bad
    error = _refused(_rewrite(path, tensors), WEIGHTS, repr(_q(2, "B")), "1 non-finite", "[5, 1]")
    assert error.key == _q(2, "B")


def test_bf16_infinity_refused(tmp_path):
    path = _adapter(tmp_path, targets=("q_proj",), rank=2, dims=BaseDims(1, 4, 4, 4, 4))
    inf_bits = np.full(8, 0x7F80, "<u2")  # bfloat16 +inf
    (path / WEIGHTS).write_bytes(_safetensors_bytes({_q(0, "A"): ("BF16", [2, 4], inf_bits.tobytes()),
                                                     _q(0, "B"): ("BF16", [4, 2], inf_bits.tobytes())}))
    _refused(path, WEIGHTS, "non-finite", dims=BaseDims(1, 4, 4, 4, 4))


# ---------------------------------------------------------------- hostile safetensors files


def _safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]], header_extra: dict | None = None,
                       length: int | None = None) -> bytes:
    """A safetensors file laid out by hand: {name: (dtype, shape, data)} in order, optional raw header edits."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header.update(header_extra or {})
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob) if length is None else length) + blob + data


def _peak_while_refused(path: Path, *words: str) -> int:
    tracemalloc.start()
    try:
        _refused(path, WEIGHTS, *words)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


PEAK_LIMIT = 256 << 10  # bytes: what a hostile file may make us allocate (it claims gigabytes)


def _tiny(tmp_path: Path) -> tuple[Path, bytes]:
    path = _adapter(tmp_path, targets=("q_proj",), rank=2)
    return path, (path / WEIGHTS).read_bytes()


def test_truncated_files_are_refused_at_every_offset_without_big_allocations(tmp_path):
    path, whole = _tiny(tmp_path)
    header_end = 8 + struct.unpack("<Q", whole[:8])[0]
    for cut in (0, 3, 7, 8, 20, header_end - 1, header_end, header_end + 5, len(whole) - 1):
        (path / WEIGHTS).write_bytes(whole[:cut])
        assert _peak_while_refused(path, "truncated") < PEAK_LIMIT, cut


def test_a_million_rank_header_is_refused_before_reading(tmp_path):
    path, _ = _tiny(tmp_path)
    rank = 10 ** 6
    a_bytes, b_bytes = rank * 16 * 4, 16 * rank * 4
    header = {_q(0, "A"): {"dtype": "F32", "shape": [rank, 16], "data_offsets": [0, a_bytes]},
              _q(0, "B"): {"dtype": "F32", "shape": [16, rank], "data_offsets": [a_bytes, a_bytes + b_bytes]}}
    (path / WEIGHTS).write_bytes(_safetensors_bytes({}, header))
    assert _peak_while_refused(path, "truncated", repr(_q(0, "A"))) < PEAK_LIMIT
    # the same claim backed by a sparse file of the full size: refused by the shape check, still unread
    with (path / WEIGHTS).open("r+b") as f:
        f.truncate(len(_safetensors_bytes({}, header)) + a_bytes + b_bytes)
    assert _peak_while_refused(path, "[1000000, 16]", "expected [2, 16]") < PEAK_LIMIT


def test_a_ten_gigabyte_tensor_claim_is_refused_before_reading(tmp_path):
    path, _ = _tiny(tmp_path)
    size = 10 * 2 ** 30
    header = {_q(0, "A"): {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}
    (path / WEIGHTS).write_bytes(_safetensors_bytes({}, header))
    assert _peak_while_refused(path, "truncated", repr(_q(0, "A"))) < PEAK_LIMIT


@pytest.mark.parametrize("length, words", [(2 ** 63, ["header length 9223372036854775808", "limit"]),
                                           ((1 << 20) + 1, ["1048577", "limit"]),
                                           (5000, ["header length 5000", "truncated"])])
def test_absurd_header_lengths_are_refused_without_reading(tmp_path, length, words):
    path, whole = _tiny(tmp_path)
    (path / WEIGHTS).write_bytes(struct.pack("<Q", length) + whole[8:])
    assert _peak_while_refused(path, *words) < PEAK_LIMIT


def _layout(path: Path, header: dict, data: bytes) -> Path:
    blob = json.dumps(header).encode()
    (path / WEIGHTS).write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def _entry(offsets: list, shape: list | None = None, dtype: str = "F32") -> dict:
    return {"dtype": dtype, "shape": shape if shape is not None else [2, 16], "data_offsets": offsets}


@pytest.mark.parametrize("header, data_len, words", [
    ({_q(0, "A"): _entry([0, 128]), _q(0, "B"): _entry([64, 192], [16, 2])}, 192, ["overlaps"]),
    ({_q(0, "A"): _entry([0, 128]), _q(0, "B"): _entry([0, 128], [16, 2])}, 128, ["overlaps"]),
    ({_q(0, "A"): _entry([0, 128]), _q(0, "B"): _entry([132, 260], [16, 2])}, 260, ["belong to no tensor"]),
    ({_q(0, "A"): _entry([0, 128])}, 200, ["72 bytes after the last tensor"]),
    ({_q(0, "A"): _entry([0, 100])}, 100, ["is 128 bytes", "span 100"]),
    ({_q(0, "A"): _entry([128, 0])}, 128, ["data_offsets [128, 0]"]),
    ({_q(0, "A"): _entry([-8, 120])}, 128, ["data_offsets [-8, 120]"]),
    ({_q(0, "A"): _entry([0, 128], [2, -16])}, 128, ["shape [2, -16]"]),
    ({_q(0, "A"): _entry([0, 128], [2, 16.0])}, 128, ["shape [2, 16.0]"]),
    ({_q(0, "A"): _entry([0, 128], dtype="I32")}, 128, ["dtype 'I32'"]),
    ({_q(0, "A"): _entry([0, 128], dtype=["F32"])}, 128, ["dtype ['F32']"]),
    ({_q(0, "A"): [0, 128]}, 128, ["not an object"]),
    ({_q(0, "A"): _entry([0, 128]), "__metadata__": {"format": 1}}, 128, ["__metadata__"]),
])
def test_bad_header_layouts_are_refused(tmp_path, header, data_len, words):
    path, _ = _tiny(tmp_path)
    _layout(path, header, b"\0" * data_len)
    assert _peak_while_refused(path, *words) < PEAK_LIMIT


@pytest.mark.parametrize("blob, words", [(b"[1, 2]", ["a JSON list"]), (b"{nope", ["not valid JSON"]),
                                         (b"\xff\xfe", ["not valid JSON"]),
                                         (b"[" * 50_000, ["nested deeper than 3 levels"]),
                                         (b'{"a": {"shape": [[0]]}}', ["nested deeper than 3 levels"]),
                                         (b'{"a": {}, "a": {}}', ["appears twice"])])
def test_headers_that_are_not_a_json_object(tmp_path, blob, words):
    path, _ = _tiny(tmp_path)
    (path / WEIGHTS).write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert _peak_while_refused(path, *words) < PEAK_LIMIT


def test_a_fifo_or_directory_in_place_of_a_file_never_hangs(tmp_path):
    path, _ = _tiny(tmp_path)
    (path / WEIGHTS).unlink()
    (path / WEIGHTS).mkdir()
    _refused(path, WEIGHTS, "not a regular file")
    (path / CONFIG).unlink()
    os.mkfifo(path / CONFIG)
    _refused(path, CONFIG, "not a regular file")


def test_deep_nesting_is_refused_before_the_parser_whatever_the_recursion_limit(tmp_path, monkeypatch):
    """The JSON parser's depth follows sys.getrecursionlimit(); the bound does not."""
    path, _ = _tiny(tmp_path)
    blob = b'{"x": ' * 150_000  # 900 KB, under the header cap
    (path / WEIGHTS).write_bytes(struct.pack("<Q", len(blob)) + blob)
    limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(1_000_000)
        # the header itself is read (it is under the cap); nothing is built from it
        assert _peak_while_refused(path, "nested deeper than 3 levels") < len(blob) + PEAK_LIMIT
    finally:
        sys.setrecursionlimit(limit)


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    path = _adapter(tmp_path, targets=("q_proj",), rank=2)
    tensors = _tensors(path)
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt", "note": '[[[[{{{{ \\" ]]'})
    assert len(load_adapter(NAME, path, DIMS).modules) == 3
