"""The graph cache's directory key (backends/mindspore/planning/graph_cache.py): the same inputs give the same key,
and a
change to any of them (a part, a model file, the weights' layout) gives another, so a graph is never loaded for a
network it was not compiled from."""
from __future__ import annotations

import json
import struct

from backends.mindspore.planning.graph_cache import graph_key


def _model(tmp_path, weights_dtype: str = "F32"):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (d / "predict.yaml").write_text("model: {}\n")
    header = json.dumps({"w": {"dtype": weights_dtype, "shape": [2, 2], "data_offsets": [0, 16]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    return d


def test_the_key_is_stable_and_follows_every_input(tmp_path):
    d = _model(tmp_path)
    key = graph_key(["Packed", "shapes(1)"], d, d / "predict.yaml")
    assert key == graph_key(["Packed", "shapes(1)"], d, d / "predict.yaml")
    assert key != graph_key(["Packed", "shapes(2)"], d, d / "predict.yaml")
    (d / "predict.yaml").write_text("model: {x: 1}\n")
    changed_yaml = graph_key(["Packed", "shapes(1)"], d, d / "predict.yaml")
    assert changed_yaml != key
    (d / "config.json").write_text(json.dumps({"hidden_size": 65}))
    assert graph_key(["Packed", "shapes(1)"], d, d / "predict.yaml") != changed_yaml
    before = graph_key(["Packed"], d, None)
    _model(tmp_path, "U8")  # the same names, other weight dtypes: a re-converted model
    (d / "config.json").write_text(json.dumps({"hidden_size": 65}))
    assert graph_key(["Packed"], d, None) != before
