"""``python deploy/fleet/fleet.py`` as a user runs it: two replicas and SMG come up, the printed URLs answer (a
completion through the gateway), and SIGINT stops everything: exit 0, every replica drained and stopped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import requests

from tests.support.fleet import FLEET_PY, smg_binary
from tests.support.http import free_port_run, free_ports
from tests.support.paths import REPO

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smg_binary() is None, reason="smg is not installed (setup.cfg extra gateway)")]


def test_the_launcher_starts_prints_and_stops_the_fleet(tmp_path, default_q4_dir):
    (gateway,), base = free_ports(1), free_port_run(2)  # the replicas: base, base + 1
    cmd = [sys.executable, str(FLEET_PY), "-n", "2", "--policy", "round_robin", "--json", "--base-port", str(base),
           "--gateway-port", str(gateway), "--prometheus-port", str(free_ports(1)[0]), "--log-dir", str(tmp_path),
           "--ready-timeout", "300", "--", str(default_q4_dir), "--ctx-size", "256"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        described = json.loads(proc.stdout.readline())
        replicas = [r["url"] for r in described["replicas"]]
        assert replicas == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        cpus = [set(r["cpus"]) for r in described["replicas"]]
        assert cpus[0] | cpus[1] <= os.sched_getaffinity(0)
        assert not cpus[0] & cpus[1] or len(os.sched_getaffinity(0)) < 2  # each its own share of the cores
        model = requests.get(replicas[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        reply = requests.post(described["gateway"] + "/v1/completions", timeout=60,
                              json={"model": model, "prompt": "Hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for i in range(2):
            log = (tmp_path / f"replica{i}.log").read_text()
            assert "shutting down" in log and "stopped" in log, log[-2000:]
        for url in [*replicas, described["gateway"]]:
            with pytest.raises(requests.ConnectionError):
                requests.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
