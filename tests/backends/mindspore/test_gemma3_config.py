"""Gemma 3's predict-yaml keys (backends/mindspore/families/gemma3.py): what the tiny checkpoint's yaml gives, the
older sliding_window_pattern, and each refusal naming its key (soft-capping, another activation or rope scaling, a
layer_types list that does not fit)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from backends.mindspore.families import load_model
from backends.mindspore.modeldir.yaml_tree import ConfigError
from tests.support.make_tiny_gemma3 import make_tiny_gemma3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3_cfg"))


def with_keys(model_dir: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the yaml (in ``tmp_path``, pointing at the checkpoint) with model_config keys set (None: removed)."""
    tree = yaml.safe_load((model_dir / "predict_tiny_gemma3.yaml").read_text())
    mc = tree["model"]["model_config"]
    for key, value in changes.items():
        mc.pop(key, None) if value is None else mc.__setitem__(key, value)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(model_dir / name)
    (tmp_path / "predict.yaml").write_text(yaml.safe_dump(tree))
    return tmp_path


def test_the_tiny_yaml_gives_the_gemma3_spec(model_dir):
    spec = load_model(model_dir)
    g = spec.gemma3
    assert spec.arch == "Gemma3ForCausalLM" and spec.qk_norm and spec.tie_word_embeddings
    assert g.sliding_layers == (True, True, False, True) and g.sliding_window == 8
    assert g.rope_local_theta == 10000.0 and spec.rope_theta == 1e6 and g.rope_scaling_factor == 2.0
    assert g.attn_scale == 24 ** -0.5


def test_sliding_window_pattern_without_layer_types(model_dir, tmp_path):
    spec = load_model(with_keys(model_dir, tmp_path, layer_types=None, sliding_window_pattern=2))
    assert spec.gemma3.sliding_layers == (True, False, True, False)


def test_a_llama_yaml_has_no_gemma3_spec(tiny_model_dir):
    assert load_model(tiny_model_dir).gemma3 is None


@pytest.mark.parametrize("changes,key,says", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping", "soft-capping is not implemented"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "soft-capping is not implemented"),
    ({"hidden_act": "silu"}, "hidden_act", "only gelu_pytorch_tanh"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling", "only {rope_type: linear"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling", "only {rope_type: linear"),
    ({"layer_types": ["sliding_attention"]}, "layer_types", "must list 4 entries"),
    ({"layer_types": ["local"] * 4}, "layer_types", "must list 4 entries"),
    ({"sliding_window": 0}, "sliding_window", "must be > 0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention", "causal only"),
])
def test_what_is_not_implemented_is_refused_naming_the_key(model_dir, tmp_path, changes, key, says):
    with pytest.raises(ConfigError, match=rf"model\.model_config\.{key}.*{says}") as err:
        load_model(with_keys(model_dir, tmp_path, **changes))
    assert "predict.yaml" in str(err.value)


def test_the_shipped_gemma3_1b_yaml_loads():
    from tests.support.paths import REPO

    spec = load_model(REPO / "configs" / "models" / "predict_gemma3_1b_it.yaml")
    assert not spec.checkpoint.exists()
    assert (spec.arch, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        "Gemma3ForCausalLM", 1152, 26, 4, 1, 256)
    assert spec.gemma3.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(26))
    assert spec.gemma3.sliding_window == 512 and spec.gemma3.attn_scale == 256 ** -0.5
    assert spec.gemma3.rope_scaling_factor == 1.0 and spec.eos_token_ids == (1, 106) and spec.tie_word_embeddings


def test_adapters_are_refused_by_the_family_rule(model_dir):
    """LoRA is not implemented for Gemma 3: its family declares no adapter slots, so the engine's adapters refuse
    (tests/backends/mindspore/test_families.py: before the weights are read)."""
    from backends.mindspore.engine.adapters import EngineAdapters
    from backends.settings import LoraSettings

    with pytest.raises(ValueError, match=r"LoRA adapters are not supported for Gemma 3 \(Gemma3ForCausalLM\)"):
        EngineAdapters(load_model(model_dir), LoraSettings(runtime_updates=True))
