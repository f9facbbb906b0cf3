"""The speculative decoding keys of the server config: ModelConfig plugin_params (the reference server's JSON
string) and ModelDeployConfig speculationGamma -> SpeculationSettings, errors naming the key and the value."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from backends.settings import SpeculationSettings
from service.config import ConfigFileError, load_server_config

MODEL = {"modelName": "m", "modelWeightPath": "m"}


def load(tmp_path: Path, plugin: dict | str | None = None, gamma: int | None = None) -> SpeculationSettings:
    deploy: dict = {"ModelConfig": [copy.deepcopy(MODEL)]}
    if plugin is not None:
        deploy["ModelConfig"][0]["plugin_params"] = plugin if isinstance(plugin, str) else json.dumps(plugin)
    if gamma is not None:
        deploy["speculationGamma"] = gamma
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"BackendConfig": {"ModelDeployConfig": deploy}}))
    return load_server_config(path).engine.speculation


@pytest.mark.parametrize("plugin, gamma, want", [
    (None, None, SpeculationSettings()),
    ("", None, SpeculationSettings()),
    (None, 6, SpeculationSettings(max_draft=6)),
    ({"plugin_type": "memory_decoding"}, None, SpeculationSettings(max_draft=8)),
    ({"plugin_type": "memory_decoding", "decoding_length": 16, "dynamic_algo": False}, 16,
     SpeculationSettings(max_draft=16, adaptive=False)),
    ({"plugin_type": "memory_decoding", "decoding_length": 4, "ngram_min": 1, "ngram_max": 5}, None,
     SpeculationSettings(max_draft=4, ngram_min=1, ngram_max=5)),
])
def test_keys_to_settings(tmp_path, plugin, gamma, want):
    assert load(tmp_path, plugin, gamma) == want
    assert load(tmp_path, plugin, gamma).enabled == (want.max_draft > 0)


@pytest.mark.parametrize("plugin, gamma, message", [
    ("{not json", None, "plugin_params '{not json' is not a JSON object"),
    ('["memory_decoding"]', None, "plugin_type ['memory_decoding'] is not supported"),
    ({"plugin_type": "la", "level": 4}, None, "plugin_type 'la' is not supported"),
    ({"plugin_type": "memory_decoding", "window": 5}, None, "unknown key 'window'"),
    ({"plugin_type": "memory_decoding", "decoding_length": 0}, None, "decoding_length 0 must be an integer in [1, 64]"),
    ({"plugin_type": "memory_decoding", "decoding_length": "8"}, None, "decoding_length '8' must be an integer"),
    ({"plugin_type": "memory_decoding", "ngram_max": 9}, None, "ngram_max 9 must be an integer in [1, 8]"),
    ({"plugin_type": "memory_decoding", "ngram_min": 3, "ngram_max": 2}, None, "ngram_min 3 must be <= ngram_max 2"),
    ({"plugin_type": "memory_decoding", "dynamic_algo": 1}, None, "dynamic_algo 1 must be true or false"),
    ({"plugin_type": "memory_decoding", "decoding_length": 16}, 8,
     "speculationGamma 8 must be >= plugin_params decoding_length 16"),
    ({"plugin_type": "draft_model"}, None, "draft_model_path None must name the draft model's directory"),
    ({"plugin_type": "draft_model", "draft_model_path": ""}, None, "draft_model_path '' must name"),
    ({"plugin_type": "draft_model", "draft_model_path": "d", "ngram_min": 1}, None,
     "unknown key 'ngram_min' (draft_model takes decoding_length, dynamic_algo, draft_model_path)"),
    ({"plugin_type": "memory_decoding", "draft_model_path": "d"}, None, "unknown key 'draft_model_path'"),
])
def test_bad_values_name_the_key(tmp_path, plugin, gamma, message):
    with pytest.raises(ConfigFileError) as caught:
        load(tmp_path, plugin, gamma)
    assert message in str(caught.value)
    assert "ModelConfig[0].plugin_params" in str(caught.value) or "speculationGamma" in str(caught.value)


def test_draft_model_keys(tmp_path):
    got = load(tmp_path, {"plugin_type": "draft_model", "draft_model_path": "drafts/small", "decoding_length": 4})
    assert got == SpeculationSettings(max_draft=4, draft_model=tmp_path / "drafts/small")  # relative to the file
    assert got.method == "draft_model" and SpeculationSettings(max_draft=4).method == "memory_decoding"
    assert load(tmp_path, {"plugin_type": "draft_model", "draft_model_path": "/abs/m", "dynamic_algo": False}) == \
        SpeculationSettings(max_draft=8, adaptive=False, draft_model=Path("/abs/m"))
