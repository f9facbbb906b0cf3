"""A minimal server config (no ScheduleConfig: the reference defaults maxSeqLen 2560, maxBatchSize 200) with
the KV cache sized from npuMemSize, as a new user runs it: ``validate-config`` and ``serve`` agree, the batch
is capped at what fits (one log line), and a budget that cannot hold one sequence stops start-up with a
message naming the keys (never an OOM kill)."""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import requests
import yaml

from tests.support.cli import CLI, run_cli
from tests.support.paths import REPO

TIMEOUT = 240
# The tiny model: 2 layers x 2 kv heads x head_dim 16 x K and V x 4 bytes = 512 bytes a token; a block of
# the default 128 tokens is 64 KiB; its max_position_embeddings 512 makes a sequence 4 blocks.
BLOCK_BYTES = 128 * 2 * 2 * 16 * 2 * 4
CAPPED_GB = 13.5 * BLOCK_BYTES / 2**30  # 13 blocks: the scratch block and 3 sequences of 4 blocks
TOO_SMALL_GB = 4.5 * BLOCK_BYTES / 2**30  # 4 blocks: the scratch block and 3 of the 4 one sequence needs


def minimal_config(tmp_path: Path, model_dir: Path, npu_mem_size: float, kv_cache_dtype: str = "float32") -> Path:
    """The block arithmetic above is float32's: the cache's format is set (kvCacheDtype)."""
    path = tmp_path / "minimal.yaml"
    model = {"modelName": "tiny", "modelWeightPath": str(model_dir), "npuMemSize": npu_mem_size,
             "kvCacheDtype": kv_cache_dtype}
    path.write_text(yaml.safe_dump({
        "ServerConfig": {"port": 0}, "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]}}}))
    return path


def test_validate_config_and_serve_cap_the_batch_at_what_the_budget_holds(tmp_path, tiny_model_dir):
    config = minimal_config(tmp_path, tiny_model_dir, CAPPED_GB)
    checked = run_cli("validate-config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert "KV cache: 13 blocks" in checked.stdout and "maxBatchSize capped from 200 to 3" in checked.stdout

    log: list[str] = []
    proc = subprocess.Popen([*CLI, "serve", "--config", str(config)], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        url = _wait_ready(proc, log)
        info = requests.get(url + "/info", timeout=10).json()
        assert info["max_concurrent_requests"] == 3
        assert info["mindserve"]["cache_blocks_total"] == 12  # usable blocks: all but the scratch block
        assert info["mindserve"]["kv_cache_dtype"] == "float32"
        lines = [line for line in log if "KV cache:" in line]
        assert len(lines) == 1 and "maxBatchSize capped from 200 to 3 (what fits)" in lines[0], lines
        answer = requests.post(url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}}, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        proc.kill()
        proc.wait(10)


def test_a_float16_cache_holds_twice_the_blocks_in_the_same_budget(tmp_path, tiny_model_dir):
    """kvCacheDtype float16: 27 blocks' room where float32 has 13; 6 sequences of 4 blocks and the scratch one."""
    checked = run_cli("validate-config", str(minimal_config(tmp_path, tiny_model_dir, CAPPED_GB, "float16")))
    assert checked.returncode == 0, checked.stderr
    assert "KV cache: 25 blocks" in checked.stdout and "(float16)" in checked.stdout, checked.stdout
    assert "maxBatchSize capped from 200 to 6" in checked.stdout


def test_a_budget_that_holds_no_sequence_stops_validate_and_serve_naming_the_keys(tmp_path, tiny_model_dir):
    config = minimal_config(tmp_path, tiny_model_dir, TOO_SMALL_GB)
    for command in (["validate-config", str(config)], ["serve", "--config", str(config)]):
        done = run_cli(*command, timeout=TIMEOUT)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        message = done.stderr
        for fragment in ("ModelConfig[0].npuMemSize: the KV cache does not hold one sequence",
                         "512 tokens (maxSeqLen 2560, capped by the model's max_position_embeddings)",
                         "cacheBlockSize 128", "needs 4 blocks", "raise npuMemSize"):
            assert fragment in message, (command, message)
        assert "listening on" not in message  # refused before any port is bound or weight loaded


def _wait_ready(proc: subprocess.Popen, log: list[str]) -> str:
    deadline = time.monotonic() + TIMEOUT
    url = None
    while time.monotonic() < deadline and proc.poll() is None:
        if url is None:
            found = [re.search(r"listening on (http://\S+) ", line) for line in list(log)]
            url = next((m.group(1) for m in found if m), None)
        else:
            try:
                if requests.get(url + "/health", timeout=10).status_code == 200:
                    return url
            except requests.RequestException:  # a busy server (compiling) may not answer in time: ask again
                pass
        time.sleep(0.2)
    raise AssertionError("server did not turn ready:\n" + "".join(log)[-3000:])
