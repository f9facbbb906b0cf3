"""The one way a measurement starts ``mindserve serve``: the command line, the process, ready at ``/health``."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bench.harness.paths import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(config: Path, port: int, *extra: str, python: str | None = None) -> list[str]:
    """``python -m service serve --config CONFIG --port PORT EXTRA...`` (the ``mindserve`` command): run with
    ``serve_env(repo)`` it is that checkout's server, whatever checkout the venv's ``mindserve`` was installed from."""
    return [python or sys.executable, "-m", "service", "serve", "--config", str(config), "--port", str(port), *extra]


def serve_env(repo: Path = REPO, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with ``repo`` first on ``PYTHONPATH`` (its ``service`` and ``backends`` are imported)."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class Served:
    """A running server: its process, its base URL and its log."""

    proc: subprocess.Popen
    base: str
    log_path: Path
    ready_s: float = 0.0

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the server drains), SIGKILL after ``timeout``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start(config: Path, *, port: int | None = None, log_path: Path, extra: Sequence[str] = (), repo: Path = REPO,
          env: dict[str, str] | None = None, nice: int = 0, python: str | None = None,
          stdout: IO | None = None) -> Served:
    """Start the server (not waiting for it); its output goes to ``log_path`` unless ``stdout`` is given."""
    port = port or free_port()
    cmd = serve_command(config, port, *extra, python=python)
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    out = stdout if stdout is not None else log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=repo, stdout=out, stderr=subprocess.STDOUT, env=serve_env(repo, env))
    return Served(proc, f"http://127.0.0.1:{port}", log_path)


def wait_ready(served: Served, timeout: float) -> float:
    """Seconds until ``GET /health`` answers 200; RuntimeError (with the log's tail) if the process exits or
    ``timeout`` passes first."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if served.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {served.proc.returncode}: {log_tail(served.log_path)}")
        try:
            with urllib.request.urlopen(served.base + "/health", timeout=5) as reply:
                if reply.status == 200:
                    served.ready_s = time.perf_counter() - started
                    return served.ready_s
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s: {log_tail(served.log_path)}")


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def server(config: Path, *, log_path: Path, ready_timeout: float = 900.0, **options) -> Iterator[Served]:
    """A server ready at ``/health`` for the ``with`` block, stopped after it (``start``'s options)."""
    served = start(config, log_path=log_path, **options)
    try:
        wait_ready(served, ready_timeout)
        yield served
    finally:
        served.stop()
