"""HAProxy on a shipped deploy/haproxy file as a real subprocess (the replicas' addresses in its environment),
its admin socket read as a table, and where the binary is."""
from __future__ import annotations

import csv
import io
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

from tests.support.paths import REPO

HAPROXY = shutil.which("haproxy", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"]))
MISSING = "haproxy is not installed (Debian package haproxy; .ci/run installs it)"
CONFIGS = REPO / "deploy" / "haproxy"


class HAProxy:
    """``haproxy -db -f deploy/haproxy/<config>`` with the replicas' addresses in its environment.

    ``replicas``: name (r1, r2, ...) → (host, business port, health port)."""

    def __init__(self, tmp_path: Path, listen: int, replicas: dict[str, tuple[str, int, int]],
                 config: str = "haproxy.cfg", **env: str) -> None:
        self.socket_path = str(tmp_path / f"haproxy-{listen}.sock")
        env = {**os.environ, "MINDSERVE_LISTEN": f"127.0.0.1:{listen}", "MINDSERVE_ADMIN_SOCKET": self.socket_path,
               **env}
        for name, (host, port, health) in replicas.items():
            env[f"MINDSERVE_{name.upper()}"] = f"{host}:{port}"
            env[f"MINDSERVE_{name.upper()}_HEALTH"] = str(health)
        path = str(CONFIGS / config)
        check = subprocess.run([HAPROXY, "-c", "-f", path], env=env, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", path], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        self.url = f"http://127.0.0.1:{listen}"

    def states(self) -> dict[str, str]:
        """Server name → HAProxy's status of it ("UP", "DOWN", "UP 1/2", ...), from the admin socket."""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2)
                s.connect(self.socket_path)
                s.sendall(b"show stat\n")
                data = b"".join(iter(lambda: s.recv(65536), b""))
        except OSError:
            return {}
        rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
        return {row["svname"]: row["status"] for row in rows if row["pxname"] == "replicas"
                and row["svname"] not in ("BACKEND", "FRONTEND")}

    def is_up(self, name: str) -> bool:
        return self.states().get(name, "").startswith("UP")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
