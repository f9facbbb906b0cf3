"""A draft model through ``mindserve serve`` (a real subprocess): the tiny model served with plugin_params
draft_model (the tiny model drafting for itself) answers as with ``speculate: false``, /info (schema-checked) says
which method and draft model run and counts the accepted drafts; a draft model of another tokenizer stops
start-up with one line naming the keys."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from service.validation import default_schemas
from tests.support.cli import server_config
from tests.support.paths import REPO
from tests.support.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow
COUNT = "one two three four five one two three four five one"


def write(tmp_path: Path, model_dir: Path, draft_dir: Path) -> Path:
    config = server_config(model_dir)
    config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] = json.dumps(
        {"plugin_type": "draft_model", "draft_model_path": str(draft_dir), "decoding_length": 3})
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_served_draft_model_answers_as_plain_decoding(tmp_path, tiny_model_dir, live_servers):
    from backends.mindspore.engine.engine import Engine
    from service.config import load_server_config

    config = load_server_config(write(tmp_path, tiny_model_dir, tiny_model_dir))
    with Engine(tiny_model_dir, config.engine, model_name="tiny") as engine:
        url = live_servers.start(engine)
        body = {"inputs": COUNT, "parameters": {"max_new_tokens": 20, "details": True, "do_sample": False,
                                               "seed": 1}}
        on = requests.post(url + "/generate", json=body, timeout=120).json()
        off = requests.post(url + "/generate", json={**body, "parameters": {**body["parameters"], "speculate": False}},
                            timeout=120).json()
        assert on == off and on["details"]["generated_tokens"] == 20
        info = requests.get(url + "/info", timeout=30).json()
        default_schemas().validate("info", info)
        spec = info["mindserve"]["speculation"]
        assert spec["method"] == "draft_model" and spec["draft_model"] == tiny_model_dir.name
        assert spec["accepted_tokens"] == spec["drafted_tokens"] > 0  # drafting for itself: all accepted


def test_a_draft_model_of_another_tokenizer_stops_serve_naming_the_keys(tmp_path, tiny_model_dir):
    other = make_tiny_model(tmp_path / "other_vocab", seed=2, vocab=320)
    proc = subprocess.run([sys.executable, "-m", "service", "serve", "--config", str(write(tmp_path, tiny_model_dir,
                                                                                            other))],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode != 0
    assert "ModelConfig[0].plugin_params draft_model_path" in proc.stderr and "modelWeightPath" in proc.stderr
    assert "Traceback" not in proc.stderr
