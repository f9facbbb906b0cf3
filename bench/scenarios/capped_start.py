"""Start ``mindserve serve`` under a hard memory cap and report whether and when it starts, and its peak RSS.

    python -m bench capped-start CONFIG --cap-gib 8 [--port 18931] [--timeout 1500] [--request]

The cap is a child of this process's memory cgroup (v2: ``memory.max``; v1: ``memory.limit_in_bytes``, swap
too where it can be set), made before the server starts, so a start that would take more is killed by the
kernel inside the cap instead of pressing on the machine. The server sizes its cache from that limit (it
reads its cgroup). Prints the start-up log's ``KV cache:`` line, seconds to the first 200 of ``/health``,
the server's VmHWM and the cgroup's own peak; with ``--request``, one greedy 64-token request. The server is
stopped (SIGINT) once measured; the cgroup is removed. Needs write access to the cgroup tree (root here).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench import harness
from bench.harness.server import serve_command, serve_env

ROOT = Path("/sys/fs/cgroup")
GIB = 1 << 30


def make_cgroup(name: str, cap: int) -> tuple[Path, str]:
    """A child cgroup of ours with ``cap`` bytes; (its directory, the file holding its peak usage)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    paths = {ctrl: path.lstrip("/") for _, ctrl, path in (line.split(":", 2) for line in lines)}
    v1 = next((p for ctrl, p in paths.items() if "memory" in ctrl.split(",")), None)
    if v1 is not None:
        where = ROOT / "memory" / v1 / name
        where.mkdir(exist_ok=True)
        (where / "memory.limit_in_bytes").write_text(str(cap))
        try:
            (where / "memory.memsw.limit_in_bytes").write_text(str(cap))
        except OSError:
            pass  # no swap accounting
        return where, "memory.max_usage_in_bytes"
    where = ROOT / paths[""] / name
    where.mkdir(exist_ok=True)
    (where / "memory.max").write_text(str(cap))
    (where / "memory.swap.max").write_text("0")
    return where, "memory.peak"


def _vm(pid: int, key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(match[1]) << 10 if match else 0


def _get(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=600 if data else 2) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return 0, b""


def run(config: Path, cap: int, port: int, timeout: float, request: bool, log_path: Path) -> dict:
    cgroup, peak_file = make_cgroup(f"capped_start_{os.getpid()}", cap)
    procs = cgroup / "cgroup.procs"
    started = time.monotonic()
    with log_path.open("wb") as log:
        server = subprocess.Popen(["nice", "-n", "5", *serve_command(config, port)], stdout=log, env=serve_env(),
                                  stderr=subprocess.STDOUT, preexec_fn=lambda: procs.write_text(str(os.getpid())))
    result = {"config": str(config), "cap_gib": cap / GIB, "healthy_after_s": None, "exit_status": None}
    hwm = 0
    try:
        while time.monotonic() - started < timeout:
            if server.poll() is not None:
                result["exit_status"] = server.returncode
                break
            hwm = max(hwm, _vm(server.pid, "VmHWM"))
            if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                result["healthy_after_s"] = round(time.monotonic() - started, 1)
                break
            time.sleep(2)
        if result["healthy_after_s"] is not None and request:
            t0 = time.monotonic()
            status, body = _get(f"http://127.0.0.1:{port}/generate", {"inputs": "The capital of France is",
                                "parameters": {"max_new_tokens": 64, "do_sample": False, "details": True}})
            result["request"] = {"status": status, "seconds": round(time.monotonic() - t0, 2),
                                 "generated_tokens": json.loads(body)["details"]["generated_tokens"] if body else 0}
        if server.poll() is None:
            hwm = max(hwm, _vm(server.pid, "VmHWM"))
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        result["exit_status"] = server.returncode
        result["peak_rss_gib"] = round(hwm / GIB, 2)
        result["cgroup_peak_gib"] = round(int((cgroup / peak_file).read_text()) / GIB, 2)
        cgroup.rmdir()
    lines = log_path.read_text(errors="replace").splitlines()
    plan = [line.split("msg=", 1)[1] for line in lines if "msg=KV cache:" in line]
    errors = [line for line in lines if "config error" in line]
    result["plan"] = plan[0] if plan else None
    result["refused"] = errors[0] if errors else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="the server config")
    parser.add_argument("--cap-gib", type=float, required=True, help="the hard memory cap, GiB")
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--timeout", type=float, default=1500, help="seconds to wait for /health (default 1500)")
    parser.add_argument("--request", action="store_true", help="send one greedy 64-token request once healthy")
    parser.add_argument("--log", type=Path, default=Path("capped_start.log"), help="the server's log")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    result = run(args.config, int(args.cap_gib * GIB), args.port, args.timeout, args.request, args.log)
    print(json.dumps(result, indent=1))
    harness.save_results(args, "capped-start", result)
    return 0 if result["healthy_after_s"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
