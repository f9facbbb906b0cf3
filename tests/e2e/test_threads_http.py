"""The served thread count: automatic from the process's affinity mask (``taskset``), the ``threads`` key, and
``serve --threads`` over the key; the start-up log and ``/info`` say how many and why."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
import yaml

from service.validation import default_schemas
from tests.support.cli import CLI, server_config
from tests.support.paths import REPO

pytestmark = pytest.mark.slow


def _serve(tmp_path, model_dir, threads_key: int | None, args: tuple[str, ...] = (), cpus: set[int] | None = None):
    """Serve the tiny model (pinned to ``cpus`` if given), ask /info and one request, stop: (log, /info)."""
    config = server_config(model_dir)
    if threads_key is not None:
        config["BackendConfig"]["ModelDeployConfig"]["threads"] = threads_key
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    # pinned by a small exec wrapper, not preexec_fn: a fork of a process with threads (a pytest-xdist worker)
    # may deadlock in preexec_fn before the exec
    pin = [sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, eval(sys.argv[1])); "
           "os.execv(sys.argv[2], sys.argv[2:])", repr(cpus)] if cpus else []
    proc = subprocess.Popen([*pin, *CLI, "serve", "--config", str(path), *args], cwd=REPO, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 300
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            found = [re.search(r"ready: .* listening on (http://\S+)", line) for line in list(log)]
            url = next((m.group(1) for m in found if m), None)
        assert url, "".join(log)[-3000:]
        info = requests.get(url + "/info", timeout=10).json()
        default_schemas().validate("info", info)  # the schema describes the threads field
        reply = requests.post(url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=120)
        assert reply.status_code == 200, reply.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        return "".join(log), info
    finally:
        if proc.poll() is None:
            proc.kill()


def test_automatic_follows_the_affinity_mask(tmp_path, tiny_model_dir):
    log, info = _serve(tmp_path, tiny_model_dir, None, cpus={0})
    threads = info["mindserve"]["threads"]
    assert threads["count"] == 1 and re.fullmatch(r"affinity mask 0(, .*)?", threads["reason"]), threads
    assert f"threads: 1 ({threads['reason']}) for the AOT kernels' pool and MindSpore's CPU ops" in log, log[-3000:]


def test_the_flag_overrides_the_key(tmp_path, tiny_model_dir):
    log, info = _serve(tmp_path, tiny_model_dir, 1, args=("--threads", "3"))
    assert info["mindserve"]["threads"] == {"count": 3, "reason": "set by the threads key / --threads"}
    assert "threads: 3 (set by the threads key / --threads)" in log, log[-3000:]
