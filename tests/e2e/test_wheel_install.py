"""The package as a container build makes it: ``pip wheel .``, the wheel installed into a fresh venv, the
installed ``mindserve`` run outside the source tree: its package data is there, ``validate-config`` passes,
and ``serve`` answers a request.

The fresh venv gets the wheel without its dependencies (MindSpore is not downloaded again): they come from
this venv's site-packages through PYTHONPATH. PYTHONPATH does not run the ``.pth`` file that makes this
venv's editable install visible, so ``service`` and ``backends`` must come from the wheel, which the first
test asserts.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from backends.mindspore.kernels import build as kbuild
from tests.support.cli import server_config
from tests.support.paths import REPO

pytestmark = pytest.mark.slow

NOT_COPIED = shutil.ignore_patterns(".git", ".venv*", ".cache", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache")


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path
    site: Path  # the fresh venv's site-packages
    env: dict[str, str]
    cwd: Path

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=self.cwd)

    @property
    def mindserve(self) -> str:
        return str(self.venv / "bin" / "mindserve")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"  # a copy: building in the shared tree would leave build/ and egg-info behind
    shutil.copytree(REPO, src, symlinks=True, ignore=NOT_COPIED)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", str(work / "dist"),
                            str(src)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("mindserve-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"], "PYTHONUNBUFFERED": "1"}
    return Installed(venv, wheel, site, env, cwd=work)


def test_the_code_comes_from_the_wheel(installed):
    out = installed.run(str(installed.venv / "bin" / "python"), "-c",
                        "import service, backends.mindspore.kernels as k; print(service.__file__); print(k.__file__)")
    assert out.returncode == 0, out.stderr
    for line in out.stdout.split():
        assert Path(line).is_relative_to(installed.site), line


def test_every_runtime_file_is_in_the_wheel(installed):
    pkg = installed.site
    schemas = sorted(p.name for p in (REPO / "schemas").glob("*.schema.json"))
    assert schemas and sorted(p.name for p in (pkg / "service" / "schemas").iterdir()) == schemas
    for name in schemas:
        assert (pkg / "service" / "schemas" / name).read_bytes() == (REPO / "schemas" / name).read_bytes()
    assert (pkg / "service" / "server.yaml").read_bytes() == (REPO / "configs" / "server.yaml").read_bytes()
    for name in (*kbuild.SOURCES, *kbuild.HEADERS):
        assert (pkg / "backends" / "mindspore" / "kernels" / name).read_bytes() == \
            (REPO / "backends" / "mindspore" / "kernels" / name).read_bytes()
    static = REPO / "service" / "static"  # the playground's files, once they exist
    for path in (p for p in static.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        assert (pkg / path.relative_to(REPO)).read_bytes() == path.read_bytes(), path
    assert not (pkg / "tests").exists()


def test_validate_config_runs_from_the_wheel(installed, tiny_model_dir):
    path = installed.cwd / "tiny.yaml"
    path.write_text(yaml.safe_dump(server_config(tiny_model_dir)))
    out = installed.run(installed.mindserve, "validate-config", str(path))
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout
    default = installed.site / "service" / "server.yaml"
    out = installed.run(installed.mindserve, "serve", "--help")
    assert out.returncode == 0 and str(default) in "".join(out.stdout.split()), out.stdout  # help text wraps
    out = installed.run(installed.mindserve, "validate-config", str(default))
    assert out.returncode == 0, out.stderr


def test_serve_answers_a_request_from_the_wheel(installed, tiny_model_dir):
    path = installed.cwd / "serve.yaml"
    path.write_text(yaml.safe_dump(server_config(tiny_model_dir)))
    proc = subprocess.Popen([installed.mindserve, "serve", "--config", str(path)], cwd=installed.cwd,
                            env=installed.env, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        url = _ready_url(proc, log, seconds=240)
        reply = requests.post(url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert isinstance(reply.json()[0]["generated_text"], str)
        bad = requests.post(url + "/", json={"inputs": "hello", "parameters": {"top_p": 1.0}}, timeout=60)
        assert bad.status_code == 422 and "top_p" in bad.json()["error"]  # the schemas, read from the wheel
        if shutil.which("g++"):  # the AOT kernels, built from the wheel's sources for this CPU's variant
            info = requests.get(url + "/info", timeout=10).json()["mindserve"]
            assert info["kernels"] == "aot"
            # the best variant this CPU runs, or the one the server's environment forces (MINDSERVE_KERNEL_ISA)
            assert info["kernel_variant"]["variant"] == kbuild.choose_variant(installed.env.get(kbuild.ISA_ENV)).name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(log)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def _ready_url(proc: subprocess.Popen, log: list[str], *, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        found = [re.search(r"ready: .* listening on (http://\S+)", line) for line in list(log)]
        url = next((m.group(1) for m in found if m), None)
        if url:
            return url
        time.sleep(0.2)
    raise AssertionError("server not ready:\n" + "".join(log)[-3000:])
