"""The ``mindserve`` command line, run as a real subprocess: validate-config, convert-gguf, serve."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.support.cli import CLI, run_cli, server_config
from tests.support.paths import REPO


def test_validate_config_accepts_the_shipped_default():
    out = run_cli("validate-config", "configs/server.yaml")
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c["ServerConfig"].update(port="abc"), "ServerConfig.port"),
    (lambda c: c["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(backendType="atb"), "backendType"),
    (lambda c: c["BackendConfig"]["ModelDeployConfig"].pop("ModelConfig"), "ModelConfig"),
    (lambda c: c["ServerConfig"].update(tokenIdFormat="hex"), "tokenIdFormat"),
    (lambda c: c["BackendConfig"]["ScheduleConfig"].update(maxPrefillBatchSize=9), "maxPrefillBatchSize"),
])
def test_bad_config_stops_with_a_message_naming_the_key(tmp_path, tiny_model_dir, mutate, key):
    cfg = server_config(tiny_model_dir)
    mutate(cfg)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for command in ("validate-config", "serve"):
        args = (command, str(path)) if command == "validate-config" else (command, "--config", str(path))
        out = run_cli(*args)
        assert out.returncode == 2, (command, out.stdout, out.stderr[-500:])
        assert key in out.stderr and "bad.yaml" in out.stderr
        assert "Traceback" not in out.stderr


def _lora_config(tmp_path, tiny_model_dir, adapter) -> str:
    cfg = server_config(tiny_model_dir)
    cfg["BackendConfig"]["ModelDeployConfig"]["LoraModules"] = [{"name": "sql", "path": str(adapter),
                                                                "baseModelName": "tiny"}]
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_lora_modules_are_checked_before_start_up(tmp_path, tiny_model_dir):
    """A good adapter passes validate-config; a broken one stops both validate-config and serve, naming the entry,
    before anything is loaded (the reference server would warn and serve without it)."""
    from backends.lora import BaseDims
    from backends.mindspore.families import load_model
    from tests.support.lora_adapters import make_adapter

    adapter = make_adapter(tmp_path / "sql", BaseDims.of(load_model(tiny_model_dir)), seed=1, rank=4)
    out = run_cli("validate-config", _lora_config(tmp_path, tiny_model_dir, adapter))
    assert out.returncode == 0, out.stderr
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    path = _lora_config(tmp_path, tiny_model_dir, adapter)
    for args in (("validate-config", path), ("serve", "--config", path)):
        out = run_cli(*args)
        assert out.returncode == 2, (args, out.stderr[-500:])
        assert "BackendConfig.ModelDeployConfig.LoraModules[0] (sql" in out.stderr, out.stderr
        assert "adapter_model.safetensors" in out.stderr and "Traceback" not in out.stderr


def test_reference_config_json_shape_is_accepted(tmp_path, tiny_model_dir):
    cfg = server_config(tiny_model_dir, managementPort=1026, metricsPort=1027, tlsCaPath="security/ca/",
                        interCommTLSEnabled=True, openAiSupport="vllm")
    cfg["BackendConfig"].update(backendName="mindieservice_llm_engine", npuDeviceIds=[[0]])
    cfg["LogConfig"] = {"dynamicLogLevel": ""}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = run_cli("validate-config", str(path))
    assert out.returncode == 0, out.stderr


def test_convert_gguf_writes_a_model_directory(tmp_path, default_gguf_path):
    out = run_cli("convert-gguf", str(default_gguf_path), str(tmp_path / "m"), "--name", "smol", "--quiet")
    assert out.returncode == 0, out.stderr
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
            "predict_smol.yaml"} <= names


def test_serve_answers_then_exits_cleanly_on_sigterm(tmp_path, tiny_model_dir):
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(server_config(tiny_model_dir)))
    proc = subprocess.Popen([*CLI, "serve", "--config", str(path)], cwd=REPO, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        url = None
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            found = [re.search(r"ready: .* listening on (http://\S+)", line) for line in list(log)]
            url = next((m.group(1) for m in found if m), None)
        assert url, "".join(log)[-3000:]
        assert any("warm-up done" in line for line in log)
        assert requests.get(url + "/health", timeout=10).status_code == 200
        reply = requests.post(url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
        assert reply.status_code == 200 and isinstance(reply.json(), list)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _serve_once(path: Path, env: dict) -> tuple[list[str], dict]:
    """Start ``mindserve serve``, ask one greedy request with details, stop it: (its log, the reply)."""
    proc = subprocess.Popen([*CLI, "serve", "--config", str(path)], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 240
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            found = [re.search(r"ready: .* listening on (http://\S+)", line) for line in list(log)]
            url = next((m.group(1) for m in found if m), None)
        assert url, "".join(log)[-3000:]
        body = {"inputs": "hello there", "parameters": {"max_new_tokens": 6, "do_sample": False, "details": True}}
        reply = requests.post(url + "/", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        return log, reply.json()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow  # starts a server twice; its model fixture is chosen by name, which the slow rule cannot see
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_qwen3_moe_dir", "tiny_gemma3_dir"])
def test_a_restart_loads_the_warm_up_graphs_from_the_graph_cache(tmp_path, request, model):
    """With graphCache, serve keeps MindSpore's compiled graphs under ~/.cache/mindserve/graphs/<digest>: the second
    start loads every one of them and answers the very same tokens and logprobs (Llama, and the architectures with
    more than the Llama layer's parameters: Qwen3-MoE's routed experts and q/k norms, Gemma 3's four norms)."""
    from backends.mindspore.kernels.build import default_cache_dir

    tiny_model_dir = request.getfixturevalue(model)

    home = tmp_path / "home"
    (home / ".cache" / "mindserve").mkdir(parents=True)
    (home / ".cache" / "mindserve" / "kernels").symlink_to(default_cache_dir(), target_is_directory=True)
    path = tmp_path / "server.yaml"
    config = server_config(tiny_model_dir)
    config["BackendConfig"]["ModelDeployConfig"]["graphCache"] = True
    path.write_text(yaml.safe_dump(config))
    first_log, first = _serve_once(path, {"HOME": str(home)})
    assert any("graph cache:" in line and "empty: compiling" in line for line in first_log), "".join(first_log)[-2000:]
    cached = list((home / ".cache" / "mindserve" / "graphs").glob("*/**/*.mindir"))
    assert cached
    second_log, second = _serve_once(path, {"HOME": str(home)})
    assert any(f"({len(cached)} graphs cached)" in line for line in second_log), "".join(second_log)[-2000:]
    assert second[0]["details"]["tokens"] == first[0]["details"]["tokens"]  # ids, logprobs (the seed is random)
    assert second[0]["generated_text"] == first[0]["generated_text"]
