"""What a result needs to be read later: the CPU, the kernels' build variant, the memory's read bandwidth, the
commit and the command line that made it."""
from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.paths import REPO

BANDWIDTH_BYTES = 256 << 20


def machine_facts(*, bandwidth: bool = True, argv: list[str] | None = None) -> dict[str, Any]:
    """The machine and the run: host, CPU model, cores, OS kernel, the kernels' ISA variant, load average,
    commit and command line; with ``bandwidth``, the single-thread read and copy bandwidth (about a second)."""
    facts: dict[str, Any] = {
        "host": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "os_kernel": platform.release(),
        "kernel_variant": kernel_variant(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "commit": commit(),
        "command": command_line(sys.argv if argv is None else argv),
        "python": platform.python_version(),
    }
    if bandwidth:
        facts["memory_bandwidth"] = memory_bandwidth()
    return facts


def command_line(argv: list[str]) -> str:
    """The command as typed: ``python -m bench serve --quick`` (``bench/__main__.py`` sets ``argv[0]`` so), or
    ``python bench/serve_bench.py --quick``."""
    head = argv[0] if argv and argv[0].startswith("python -m ") else shlex.join([Path(sys.executable).name,
                                                                                 *argv[:1]])
    return " ".join([head, *map(shlex.quote, argv[1:])])


def cpu_model(cpuinfo: str | None = None) -> str:
    """``model name`` of /proc/cpuinfo (x86), else its ``CPU part``/``Hardware`` line, else platform's guess."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for key in ("model name", "Hardware", "CPU part"):
        for line in cpuinfo.splitlines():
            if line.startswith(key) and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def kernel_variant() -> str | None:
    """The AOT kernels' build variant this machine runs (``x86-64-v4-vnni``, ``armv8``, ...; the
    ``MINDSERVE_KERNEL_ISA`` override included); None when no variant runs here."""
    from backends.mindspore.kernels.build import KernelBuildError, choose_variant

    try:
        return choose_variant().name
    except KernelBuildError:
        return None


def commit(repo: Path = REPO) -> str | None:
    """The checked-out commit, ``+dirty`` when tracked files differ from it; None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "--short=12", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def memory_bandwidth(reps: int = 5, nbytes: int = BANDWIDTH_BYTES) -> dict[str, Any]:
    """GB/s, best of ``reps``, one thread: ``read_gbs`` = the sum of an ``nbytes`` float32 array (bytes read ÷
    time: what single-stream decode, which reads every weight once a token, is bound by), ``copy_gbs`` = a copy
    into another (bytes read + written ÷ time)."""
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)  # both touched: no page faults inside the timings
    copy, read = [], []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        copy.append(2 * nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        src.sum()
        read.append(nbytes / (time.perf_counter() - t) / 1e9)
    return {"copy_gbs": max(copy), "read_gbs": max(read), "copy_all": copy, "read_all": read}
