"""Several models in one server (service/models.py): the real CLI (``mindserve serve``) on a real socket, two
real models (the default SmolLM2 as shipped, Q4_1, and the same GGUF requantized to Q8_0 under another name),
asked by name with the official ``openai`` client; ``maxLoadedModels: 1`` swapping them under concurrent load;
the memory budget across models and duplicate names refused before anything loads."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import openai
import pytest
import requests
import yaml

from service.validation import default_schemas
from tests.support.cli import run_cli
from tests.support.served import Served

pytestmark = pytest.mark.slow

A, B = "smol-q4", "smol-q8"


def config(tmp_path: Path, q4: Path, q8: Path, **deploy) -> Path:
    path = tmp_path / "server.yaml"
    models = [{"modelName": A, "modelWeightPath": str(q4), "npuMemSize": 0.05},
              {"modelName": B, "modelWeightPath": str(q8), "npuMemSize": 0.05}]
    path.write_text(yaml.safe_dump({
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 0, "e2eTimeout": 300, "tokenTimeout": 300},
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 256, "maxInputTokenLen": 200, "ModelConfig": models, **deploy},
            "ScheduleConfig": {"maxBatchSize": 4, "maxPrefillBatchSize": 2, "maxIterTimes": 64,
                               "cacheBlockSize": 64, "batchBuckets": [1, 2, 4]}}}))
    return path


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


def complete(url: str, model: str, prompt: str = "The capital of France is", tokens: int = 8) -> str:
    reply = client(url).completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0)
    assert reply.model == model
    return reply.choices[0].text


def metric(text: str, name: str, model: str) -> float:
    found = re.search(rf'^{name}{{model_name="{re.escape(model)}"}} (\S+)$', text, re.M)
    assert found, f"{name} of {model} not in /metrics"
    return float(found.group(1))


@pytest.fixture()
def serve():
    started = []

    def start(path: Path) -> tuple[str, Served]:
        served = Served(path)
        started.append(served)
        return served.wait_url(timeout=600), served
    yield start
    for served in started:
        served.stop()


def test_two_models_each_answer_by_name(tmp_path, default_q4_dir, default_q8_dir, serve):
    url, _ = serve(config(tmp_path, default_q4_dir, default_q8_dir))
    oa = client(url)
    assert [m.id for m in oa.models.list()] == [A, B]
    a, b = complete(url, A), complete(url, B)
    assert a and b
    chat = oa.chat.completions.create(model=B, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == B and chat.choices[0].message.content
    # POST / names no model: the first one serves it, token for token what model A gives
    root = requests.post(url + "/", json={"inputs": "The capital of France is",
                                          "parameters": {"max_new_tokens": 8}}, timeout=300)
    assert root.status_code == 200 and root.json()[0]["generated_text"] == a
    with pytest.raises(openai.NotFoundError) as err:
        complete(url, "no-such-model")
    assert err.value.code == "model_not_found" and A in err.value.message and B in err.value.message
    tokens = requests.post(url + "/tokenize", json={"model": B, "prompt": "Hello"}, timeout=60).json()
    assert tokens["count"] >= 1
    info = requests.get(url + "/info", timeout=30).json()
    default_schemas().validate("info", info)
    assert [m["model_id"] for m in info["models"]] == [A, B]
    assert [(m["name"], m["state"], m["loads"]) for m in info["mindserve"]["models"]] == [(A, "loaded", 1),
                                                                                          (B, "loaded", 1)]


def test_lru_swaps_models_under_concurrent_load(tmp_path, default_q4_dir, default_q8_dir, serve):
    url, served = serve(config(tmp_path, default_q4_dir, default_q8_dir, maxLoadedModels=1))
    info = requests.get(url + "/info", timeout=30).json()
    assert [m["state"] for m in info["mindserve"]["models"]] == ["loaded", "unloaded"]
    expected = {A: complete(url, A)}  # greedy: the same text whenever a model answers, loaded again or not
    failures, answers = [], []

    def worker(index: int) -> None:
        for turn in range(4):
            model = (A, B)[(index + turn) % 2]
            try:
                answers.append((model, complete(url, model)))
            except Exception as exc:  # noqa: BLE001 - every failure is collected and reported
                failures.append(f"{model}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not failures, failures
    assert len(answers) == 16
    for model, text in answers:
        expected.setdefault(model, text)
        assert text == expected[model], model
    info = requests.get(url + "/info", timeout=30).json()
    default_schemas().validate("info", info)
    models = {m["name"]: m for m in info["mindserve"]["models"]}
    assert models[B]["loads"] >= 1 and models[A]["unloads"] >= 1
    assert sum(m["state"] == "loaded" for m in models.values()) <= 1
    assert info["mindserve"]["max_loaded_models"] == 1
    text = requests.get(url + "/metrics", timeout=30).text
    assert metric(text, "model_loads_total", B) == models[B]["loads"]
    assert metric(text, "model_unloads_total", A) == models[A]["unloads"]
    assert metric(text, "model_load_duration_seconds_count", B) == models[B]["loads"]
    assert "unloading" in served.text() and "loaded in" in served.text()


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    raise AssertionError("no MemAvailable")


@pytest.mark.alone  # the memory free now sizes the config: another test's model loading meanwhile would move it
def test_a_config_that_cannot_hold_every_model_fails_naming_the_keys(tmp_path, default_q4_dir, default_q8_dir):
    """Each model's cache alone fits the memory free now, both at once do not: refused before loading anything,
    naming the second model's npuMemSize and maxLoadedModels; one model at a time fits."""
    path = config(tmp_path, default_q4_dir, default_q8_dir)
    data = yaml.safe_load(path.read_text())
    share = round(_available_gib() * 0.55, 2)
    for model in data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]:
        model["npuMemSize"] = share
    data["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] = 4096
    del data["BackendConfig"]["ScheduleConfig"]["batchBuckets"]
    path.write_text(yaml.safe_dump(data))
    done = run_cli("validate-config", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "ModelConfig[1].npuMemSize (with 2 models loaded at once: BackendConfig.ModelDeployConfig." \
           "maxLoadedModels" in done.stderr, done.stderr
    data["BackendConfig"]["ModelDeployConfig"]["maxLoadedModels"] = 1
    path.write_text(yaml.safe_dump(data))
    done = run_cli("validate-config", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_duplicate_model_names_are_refused(tmp_path, default_q4_dir, default_q8_dir):
    path = config(tmp_path, default_q4_dir, default_q8_dir)
    path.write_text(path.read_text().replace(B, A))
    done = run_cli("serve", "--config", str(path))
    assert done.returncode == 2
    assert done.stderr.strip().endswith("BackendConfig.ModelDeployConfig.ModelConfig[1].modelName 'smol-q4' is "
                                        "already the modelName of ModelConfig[0]; model names must be unique")
