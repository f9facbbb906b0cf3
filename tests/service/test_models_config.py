"""Several ModelConfig entries (service/config.py): each its own engine, names unique, adapters per model."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.config import ConfigFileError, load_server_config


def write(tmp_path: Path, models: list[dict], **deploy) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": models, **deploy}}}))
    return path


def test_every_entry_is_a_model_with_its_own_keys(tmp_path):
    config = load_server_config(write(tmp_path, [
        {"modelName": "a", "modelWeightPath": "da", "npuMemSize": 0.5, "kvCacheDtype": "q8_0"},
        {"modelName": "b", "modelWeightPath": "db", "plugin_params": '{"plugin_type": "memory_decoding"}'},
    ], maxSeqLen=600, maxLoadedModels=1))
    a, b = config.models
    assert (a.name, a.index, a.weight_path, b.name, b.index, b.weight_path) == (
        "a", 0, tmp_path / "da", "b", 1, tmp_path / "db")
    assert (a.engine.cache_gb, a.engine.kv_cache_dtype, a.engine.speculation.enabled) == (0.5, "q8_0", False)
    assert (b.engine.cache_gb, b.engine.kv_cache_dtype, b.engine.speculation.method) == (-1, "auto", "memory_decoding")
    assert a.engine.max_seq_len == b.engine.max_seq_len == 600  # the shared keys apply to both
    assert config.model is a and config.engine is a.engine and config.max_loaded_models == 1
    assert config.resident_models == 1 and b.key == "BackendConfig.ModelDeployConfig.ModelConfig[1]"


def test_all_models_are_resident_by_default(tmp_path):
    config = load_server_config(write(tmp_path, [{"modelName": "a", "modelWeightPath": "a"},
                                                 {"modelName": "b", "modelWeightPath": "b"}]))
    assert (config.max_loaded_models, config.resident_models) == (0, 2)
    config = load_server_config(write(tmp_path, [{"modelName": "a", "modelWeightPath": "a"}], maxLoadedModels=5))
    assert config.resident_models == 1


def test_a_duplicate_model_name_names_both_entries(tmp_path):
    with pytest.raises(ConfigFileError) as err:
        load_server_config(write(tmp_path, [{"modelName": "a", "modelWeightPath": "x"},
                                            {"modelName": "b", "modelWeightPath": "y"},
                                            {"modelName": "a", "modelWeightPath": "z"}]))
    assert str(err.value) == (f"{tmp_path / 'server.yaml'}: BackendConfig.ModelDeployConfig.ModelConfig[2].modelName "
                              "'a' is already the modelName of ModelConfig[0]; model names must be unique")


def test_each_model_gets_its_own_lora_modules(tmp_path):
    config = load_server_config(write(tmp_path, [{"modelName": "a", "modelWeightPath": "x"},
                                                 {"modelName": "b", "modelWeightPath": "y"}],
                                      LoraModules=[{"name": "la", "path": "pa", "baseModelName": "a"},
                                                   {"name": "lb", "path": "pb", "baseModelName": "b"},
                                                   {"name": "lb2", "path": "pb2", "baseModelName": "b"}],
                                      allowRuntimeLoraUpdating=True, loraRoot="/tmp"))
    a, b = config.models
    assert [m.name for m in a.engine.lora.modules] == ["la"]
    assert [m.name for m in b.engine.lora.modules] == ["lb", "lb2"]
    assert (a.engine.lora.runtime_updates, b.engine.lora.runtime_updates) == (True, False)  # the first model's


def test_an_adapter_may_not_take_a_model_name(tmp_path):
    with pytest.raises(ConfigFileError, match=r"LoraModules\[0\]\.name 'b' is already the modelName of "
                                              r"ModelConfig\[1\]"):
        load_server_config(write(tmp_path, [{"modelName": "a", "modelWeightPath": "x"},
                                            {"modelName": "b", "modelWeightPath": "y"}],
                                 LoraModules=[{"name": "b", "path": "p", "baseModelName": "a"}]))


def test_plugin_params_errors_name_their_entry(tmp_path):
    with pytest.raises(ConfigFileError, match=r"ModelConfig\[1\]\.plugin_params"):
        load_server_config(write(tmp_path, [{"modelName": "a", "modelWeightPath": "x"},
                                            {"modelName": "b", "modelWeightPath": "y", "plugin_params": "nope"}]))
