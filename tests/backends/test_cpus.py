"""The engine's default thread count from fake sysfs / procfs roots: affinity, SMT siblings, cgroup quotas."""
from __future__ import annotations

from pathlib import Path

import pytest

from backends.cpus import MAX_THREADS, ThreadCount, engine_threads, usable_cpus


def _root(tmp_path: Path, siblings: dict[int, str] | None = None, cgroup: str | None = None,
          files: dict[str, str] | None = None) -> Path:
    """A fake ``/``: each CPU's thread_siblings_list, /proc/self/cgroup, and any other files."""
    for cpu, text in (siblings or {}).items():
        path = tmp_path / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    if cgroup is not None:
        (tmp_path / "proc/self").mkdir(parents=True, exist_ok=True)
        (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


SMT8 = {c: f"{c % 4},{c % 4 + 4}" for c in range(8)}  # 4 cores, 2 threads each: cpu c and c + 4 are siblings
PLAIN2 = {0: "0", 1: "1"}
V2 = "0::/user.slice/app.scope\n"

CASES = [
    # (name, affinity, siblings, /proc/self/cgroup, other files, count, reason)
    ("no sysfs: logical CPUs", range(4), None, None, {}, 4, "affinity mask 0-3"),
    ("no SMT", [0, 1], PLAIN2, None, {}, 2, "affinity mask 0-1, 2 physical cores"),
    ("taskset to one CPU", [1], PLAIN2, None, {}, 1, "affinity mask 1, 1 physical core"),
    ("SMT siblings counted once", range(8), SMT8, None, {}, 4,
     "affinity mask 0-7, 4 physical cores (SMT siblings counted once)"),
    ("mask of one thread per core", [0, 1, 2, 3], SMT8, None, {}, 4, "affinity mask 0-3, 4 physical cores"),
    ("mask of both threads of two cores", [0, 4, 1, 5], SMT8, None, {}, 2,
     "affinity mask 0-1,4-5, 2 physical cores (SMT siblings counted once)"),
    ("a CPU without topology is its own core", [0, 4, 9], SMT8, None, {}, 2,
     "affinity mask 0,4,9, 2 physical cores (SMT siblings counted once)"),
    ("v2 quota rounds up", range(8), SMT8, V2, {"sys/fs/cgroup/user.slice/app.scope/cpu.max": "150000 100000"}, 2,
     "affinity mask 0-7, 4 physical cores (SMT siblings counted once), capped by the cgroup CPU quota of 1.5 CPUs"),
    ("v2 quota of a parent", range(8), SMT8, V2, {"sys/fs/cgroup/user.slice/app.scope/cpu.max": "max 100000",
                                                  "sys/fs/cgroup/user.slice/cpu.max": "100000 100000"}, 1,
     "affinity mask 0-7, 4 physical cores (SMT siblings counted once), capped by the cgroup CPU quota of 1 CPU"),
    ("v2 no quota", range(8), SMT8, V2, {"sys/fs/cgroup/user.slice/app.scope/cpu.max": "max 100000"}, 4,
     "affinity mask 0-7, 4 physical cores (SMT siblings counted once)"),
    ("v2 quota above the cores leaves them", [0, 1], PLAIN2, V2,
     {"sys/fs/cgroup/user.slice/app.scope/cpu.max": "800000 100000"}, 2, "affinity mask 0-1, 2 physical cores"),
    ("v2 host path, container's own cgroup at the root", [0, 1], PLAIN2, "0::/docker/abc\n",
     {"sys/fs/cgroup/cpu.max": "50000 100000"}, 1,
     "affinity mask 0-1, 2 physical cores, capped by the cgroup CPU quota of 0.5 CPUs"),
    ("v1 cpu,cpuacct quota", range(4), None, "4:cpu,cpuacct:/job\n3:memory:/job\n",
     {"sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "250000", "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us":
      "100000"}, 3, "affinity mask 0-3, capped by the cgroup CPU quota of 2.5 CPUs"),
    ("v1 unlimited (-1)", range(4), None, "1:cpu:/\n",
     {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"}, 4,
     "affinity mask 0-3"),
    ("v1 this box's shape: cpu at /, no quota files", [0, 1], PLAIN2, "1:cpu:/\n0::/\n", {}, 2,
     "affinity mask 0-1, 2 physical cores"),
    ("garbage files are ignored", [0, 1], {0: "zero", 1: "1"}, "nonsense\n0::/x\n",
     {"sys/fs/cgroup/x/cpu.max": "lots"}, 2, "affinity mask 0-1, 2 physical cores"),
]


@pytest.mark.parametrize("name, affinity, siblings, cgroup, files, count, reason", CASES, ids=[c[0] for c in CASES])
def test_usable_cpus(tmp_path, name, affinity, siblings, cgroup, files, count, reason):
    root = _root(tmp_path, siblings, cgroup, files)
    assert usable_cpus(affinity, root) == ThreadCount(count, reason)


def test_capped_at_the_pool_limit(tmp_path):
    got = usable_cpus(range(MAX_THREADS + 8), tmp_path)
    assert got.count == MAX_THREADS and got.reason.endswith(f"capped at the kernel pool's {MAX_THREADS}")


def test_setting_wins(tmp_path):
    assert engine_threads(3, tmp_path) == ThreadCount(3, "set by the threads key / --threads")


def test_automatic_reads_this_process(tmp_path):
    import os

    got = engine_threads(None, tmp_path)  # an empty root: no topology, no cgroup
    assert got.count == len(os.sched_getaffinity(0))
