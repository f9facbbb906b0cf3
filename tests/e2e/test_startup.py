"""``mindserve serve`` start-up, as a real subprocess: the ports open before the model is loaded, so
``/health`` is 503 during load and warm-up and 200 after; a failed load or warm-up exits 1; a signal
during warm-up exits at once; the management plane listens on ``managementIpAddress``.

The gated runs start the CLI through a bootstrap that holds ``ModelRunner.warmup`` until the test
creates a file (or makes it raise), so the 503 window is as long as the test needs; the rest is the
real ``serve``.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from service.validation import default_schemas
from tests.support.cli import server_config
from tests.support.http import free_ports
from tests.support.paths import REPO

TIMEOUT = 240
NOT_LOADED = "the model is still loading or warming up"
BOOTSTRAP = """
import os, sys, time
from backends.mindspore.runners import ModelRunner
warmup, gate = ModelRunner.warmup, sys.argv[1]
def gated(self, *args, **kwargs):
    while not os.path.exists(gate):
        time.sleep(0.05)
    if open(gate).read() == "fail":
        raise RuntimeError("injected warm-up failure")
    return warmup(self, *args, **kwargs)
ModelRunner.warmup = gated
from service.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


class Server:
    """``mindserve serve`` in a subprocess (gated by ``gate`` when given); ``log`` holds its stderr lines."""

    def __init__(self, config: Path, gate: Path | None = None) -> None:
        prefix = [sys.executable, "-c", BOOTSTRAP, str(gate)] if gate else [sys.executable, "-m", "service"]
        self.proc = subprocess.Popen([*prefix, "serve", "--config", str(config)], cwd=REPO, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()

    def text(self) -> str:
        return "".join(self.log)

    def urls(self, count: int = 1, timeout: float = TIMEOUT) -> dict[str, str]:
        """{planes: url} of the first ``count`` "listening on" lines."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = [re.search(r"listening on (http://\S+) \(([a-z, ]+);", line) for line in list(self.log)]
            urls = {m.group(2): m.group(1) for m in found if m}
            if len(urls) >= count:
                return urls
            time.sleep(0.1)
        raise AssertionError("server did not listen:\n" + self.text()[-3000:])

    def line_index(self, fragment: str) -> int:
        return next(i for i, line in enumerate(list(self.log)) if fragment in line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def write(tmp_path: Path, model_dir: Path, **server) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(server_config(model_dir, **server)))
    return path


def poll_health(url: str, timeout: float = TIMEOUT) -> list[int]:
    """/health statuses, polled until the first 200."""
    seen: list[int] = []
    error: requests.RequestException | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(requests.get(url + "/health", timeout=10).status_code)
        except requests.RequestException as exc:  # a busy server (compiling) may not answer in time: ask again
            error = exc
            time.sleep(0.1)
            continue
        if seen[-1] == 200:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"/health never turned 200: {seen[-5:]}; last error: {error!r}")


def test_health_is_503_during_load_and_warm_up_then_200(tmp_path, tiny_model_dir):
    gate = tmp_path / "gate"
    server = Server(write(tmp_path, tiny_model_dir), gate)
    try:
        url = server.urls()["business, management, metrics"]
        # loading: the probes answer, generation does not
        for path in ("/health", "/v2/health/ready"):
            reply = requests.get(url + path, timeout=10)
            assert reply.status_code == 503, path
            assert reply.json() == {"error": NOT_LOADED, "error_type": "Service Unavailable"}
            assert requests.head(url + path, timeout=10).status_code == 503
        assert requests.get(url + "/v2/health/live", timeout=10).status_code == 200
        reply = requests.post(url + "/", json={"inputs": "hello"}, timeout=10)
        assert (reply.status_code, reply.json()) == (503, {"error": NOT_LOADED, "error_type": "Service Unavailable"})
        reply = requests.post(url + "/generate_stream", json={"inputs": "hello"}, timeout=10)
        assert reply.status_code == 503 and reply.headers["Content-Type"].startswith("application/json")
        reply = requests.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello"}, timeout=10)
        assert reply.status_code == 503 and reply.json()["error"]["message"] == NOT_LOADED
        reply = requests.post(url + "/v1/tokenizer", json={"inputs": "hello"}, timeout=10)
        assert (reply.status_code, reply.json()["error"]) == (503, NOT_LOADED)
        info = requests.get(url + "/info", timeout=10).json()
        default_schemas().validate("info", info)
        assert info["mindserve"]["ready"] is False and info["models"][0]["model_id"] == "tiny"
        assert info["max_concurrent_requests"] == 2 and info["models"][0]["max_total_tokens"] == 64
        assert requests.get(url + "/metrics", timeout=10).status_code == 200
        assert requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
        assert not any("warm-up done" in line or "ready:" in line for line in server.log)

        gate.write_text("go")
        seen = poll_health(url)
        assert seen[0] == 503 and seen[-1] == 200 and set(seen) == {503, 200}
        assert requests.head(url + "/health", timeout=10).status_code == 200
        assert requests.get(url + "/info", timeout=10).json()["mindserve"]["ready"] is True
        reply = requests.post(url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
        assert reply.status_code == 200 and reply.json()[0]["generated_text"]
        assert server.line_index("listening on") < server.line_index("warm-up done") < server.line_index("ready:")
        assert re.search(r"ready: model tiny loaded and warmed up in [0-9.]+s; listening on " + re.escape(url),
                         server.text())
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.text()[-2000:]
    finally:
        server.stop()


def test_a_warm_up_failure_exits_1_with_a_clear_log(tmp_path, tiny_model_dir):
    gate = tmp_path / "gate"
    server = Server(write(tmp_path, tiny_model_dir), gate)
    try:
        url = server.urls()["business, management, metrics"]
        assert requests.get(url + "/health", timeout=10).status_code == 503
        gate.write_text("fail")
        assert server.proc.wait(60) == 1, server.text()[-2000:]
        assert ("start-up failed: the model could not be loaded or warmed up: RuntimeError: injected warm-up "
                "failure") in server.text()
        with pytest.raises(requests.ConnectionError):  # the ports are closed again
            requests.get(url + "/health", timeout=5)
    finally:
        server.stop()


def test_unloadable_weights_exit_1_without_hanging(tmp_path, tiny_model_dir):
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    server = Server(write(tmp_path, model))
    try:
        assert server.proc.wait(120) == 1, server.text()[-2000:]
        assert "start-up failed: the model could not be loaded or warmed up" in server.text()
        assert server.line_index("listening on") < server.line_index("start-up failed")
    finally:
        server.stop()


def test_a_signal_during_warm_up_stops_at_once(tmp_path, tiny_model_dir):
    server = Server(write(tmp_path, tiny_model_dir), tmp_path / "gate-never-opened")
    try:
        url = server.urls()["business, management, metrics"]
        assert requests.get(url + "/health", timeout=10).status_code == 503
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.text()[-2000:]
        assert time.monotonic() - signalled < 10
        assert "stopping before the model finished loading" in server.text()
        assert "Traceback" not in server.text()
    finally:
        server.stop()


def test_management_plane_listens_on_management_ip_address(tmp_path, tiny_model_dir):
    (port,) = free_ports(1)
    server = Server(write(tmp_path, tiny_model_dir, port=port, managementIpAddress="127.0.0.2"))
    try:
        urls = server.urls(2)
        assert urls == {"business": f"http://127.0.0.1:{port}", "management, metrics": f"http://127.0.0.2:{port}"}
        management, business = urls["management, metrics"], urls["business"]
        poll_health(management)
        assert requests.get(management + "/metrics", timeout=10).status_code == 200
        assert requests.get(business + "/health", timeout=10).status_code == 404
        assert requests.post(management + "/", json={"inputs": "x"}, timeout=10).status_code == 404
        reply = requests.post(business + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
        assert reply.status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


# --- the stand-in backend ----------------------------------------------------------------------------

class _Closable:
    model_name = "m"
    closed = False

    def close(self) -> None:
        self.closed = True

    def info(self) -> dict:
        return {"running": 0}


def test_loading_backend_refuses_until_attached_then_forwards():
    from backends.errors import EngineUnavailable
    from backends.settings import EngineConfig
    from backends.types import RequestParams
    from service.loading import LoadingBackend

    backend = LoadingBackend("m", EngineConfig(max_seq_len=64, max_input_tokens=100, max_batch_size=2))
    for call in (lambda: backend.submit("x", RequestParams()), lambda: backend.tokenize("x"),
                 lambda: backend.count_tokens("x"), lambda: backend.apply_chat_template([])):
        with pytest.raises(EngineUnavailable, match=NOT_LOADED):
            call()
    assert backend.info()["max_input_tokens"] == 63 and backend.info()["max_batch_size"] == 2
    real = _Closable()
    backend.attach(real)
    assert backend.loaded and backend.info() == {"running": 0}
    backend.close()
    assert real.closed


def test_a_backend_loaded_after_close_is_closed_at_once():
    from backends.settings import EngineConfig
    from service.loading import LoadingBackend

    backend = LoadingBackend("m", EngineConfig())
    backend.close()  # serve stopped during warm-up
    late = _Closable()
    backend.attach(late)
    assert late.closed


def test_a_yaml_device_target_without_its_runtime_exits_1_with_one_clear_line(tmp_path, tiny_model_dir):
    """A yaml saying Ascend on a CPU-only box: one log line naming the yaml key and what was found, no
    traceback, exit 1."""
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    yaml_path = model / "predict_tiny.yaml"
    yaml_path.write_text(yaml_path.read_text(encoding="utf-8").replace("device_target: CPU", "device_target: Ascend"),
                         encoding="utf-8")
    server = Server(write(tmp_path, model))
    try:
        assert server.proc.wait(120) == 1, server.text()[-2000:]
        failed = [line for line in server.log if "start-up failed" in line]
        assert len(failed) == 1, server.text()[-2000:]
        assert f"ConfigError: {yaml_path}: context.device_target: Ascend, but this MindSpore" in failed[0]
        assert "has no Ascend runtime (found: CPU)" in failed[0]
        assert "Traceback" not in server.text()
    finally:
        server.stop()
