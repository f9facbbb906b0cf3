"""How many threads the engine runs: the ``threads`` setting, else the CPUs this process may run on (its
affinity mask, as taskset and cgroup cpusets set it; SMT siblings counted once where sysfs says which they
are), capped by a cgroup CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``) rounded up."""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MAX_THREADS = 256  # the kernel pool's limit (kernels/pool.h kMaxThreads) and the threads key's maximum


@dataclass(frozen=True, slots=True)
class ThreadCount:
    """The engine's thread count and why it is that (the start-up log and ``/info`` say both)."""

    count: int
    reason: str


def engine_threads(setting: int | None, root: Path = Path("/")) -> ThreadCount:
    """``setting`` (the config's ``threads`` key or ``--threads``) if given, else ``usable_cpus``."""
    if setting is not None:
        return ThreadCount(setting, "set by the threads key / --threads")
    if not hasattr(os, "sched_getaffinity"):  # no affinity masks here (macOS): every CPU
        return usable_cpus(range(os.cpu_count() or 1), root)
    return usable_cpus(os.sched_getaffinity(0), root)


def usable_cpus(affinity: Iterable[int], root: Path = Path("/")) -> ThreadCount:
    """The CPUs of ``affinity`` counted as physical cores (``root``'s sysfs topology), capped by the quota of
    the process's cgroup (``root``'s /proc/self/cgroup and /sys/fs/cgroup) rounded up; at least 1."""
    cpus = sorted(set(affinity))
    cores = _physical_cores(cpus, root)
    reason = f"affinity mask {_ranges(cpus)}"
    count = len(cpus)
    if cores is not None and cores < len(cpus):
        reason += f", {_cores(cores)} (SMT siblings counted once)"
        count = cores
    elif cores is not None:
        reason += f", {_cores(cores)}"
    quota = _cgroup_quota(root)
    if quota is not None and math.ceil(quota) < count:
        count = math.ceil(quota)
        reason += f", capped by the cgroup CPU quota of {quota:g} CPU{'' if quota == 1 else 's'}"
    if count > MAX_THREADS:
        count, reason = MAX_THREADS, reason + f", capped at the kernel pool's {MAX_THREADS}"
    return ThreadCount(max(1, count), reason)


def _physical_cores(cpus: list[int], root: Path) -> int | None:
    """Distinct cores among ``cpus`` (a CPU's thread_siblings_list names its core); None when sysfs has no
    topology for any of them (a CPU without one counts as a core of its own)."""
    cores, known = set(), False
    for cpu in cpus:
        path = root / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            cores.add(frozenset(_parse_list(path.read_text())))
            known = True
        except (OSError, ValueError):
            cores.add(frozenset({cpu}))
    return len(cores) if known else None


def _cgroup_quota(root: Path) -> float | None:
    """The lowest CPU quota (CPUs: quota / period) of the process's cgroup and its ancestors, or None."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2 (the unified hierarchy)
            quotas += [q for d in _ancestors(root / "sys/fs/cgroup", path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu,cpuacct", "cpu"):
                base = root / "sys/fs/cgroup" / mount
                if base.is_dir():
                    quotas += [q for d in _ancestors(base, path) if (q := _v1_quota(d)) is not None]
                    break
    return min(quotas) if quotas else None


def _ancestors(base: Path, path: str) -> list[Path]:
    """``base``/``path`` and its parents up to ``base``, the ones that exist (in a container the path can be
    the host's, under which only ``base``, the container's own cgroup, is mounted)."""
    parts = [p for p in path.strip().split("/") if p]
    dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" or int(period) <= 0 else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _parse_list(text: str) -> list[int]:
    """A sysfs CPU list (``0-3,8,10-11``) as its CPUs."""
    cpus = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _cores(n: int) -> str:
    return f"{n} physical core{'' if n == 1 else 's'}"


def _ranges(cpus: list[int]) -> str:
    """Sorted CPUs as a sysfs-style list (``0-3,8``)."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
