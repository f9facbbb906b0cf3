"""The memory this process may still take: MemAvailable, or its cgroup's headroom where that is tighter (what
``memory.py``'s budget starts from). No MindSpore import."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NO_LIMIT = 1 << 60  # cgroup limits at or above this mean "no limit"


@dataclass(frozen=True, slots=True)
class Available:
    bytes: int
    source: str  # "MemAvailable", or "the cgroup limit" when that is tighter


def available_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> Available:
    """Memory this process may still take: MemAvailable, or the cgroup's headroom (limit - usage not
    counting reclaimable file pages) when a limit is set and tighter."""
    available = Available(_meminfo(proc / "meminfo").get("MemAvailable", 0), "MemAvailable")
    headroom = _cgroup_headroom(proc / "self" / "cgroup", cgroup_root)
    if headroom is not None and headroom < available.bytes:
        return Available(max(headroom, 0), "the cgroup memory limit")
    return available


def _meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cgroup_headroom(self_cgroup: Path, root: Path) -> int | None:
    """limit - (usage - inactive file pages) of this process's memory cgroup (v2, else v1); None: no limit."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    paths = {ctrl: path.lstrip("/") for _, ctrl, path in (line.split(":", 2) for line in lines if line.count(":") >= 2)}
    candidates = []
    if "" in paths:  # v2: "0::/path"
        candidates += [(root / paths[""], "memory.max", "memory.current", "inactive_file"),
                       (root, "memory.max", "memory.current", "inactive_file")]
    v1 = next((p for ctrl, p in paths.items() if "memory" in ctrl.split(",")), None)
    if v1 is not None:
        candidates += [(root / "memory" / v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
                       (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")]
    for where, limit_file, usage_file, inactive_key in candidates:
        try:
            limit_text = (where / limit_file).read_text().strip()
            usage = int((where / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= NO_LIMIT:
            return None
        return int(limit_text) - usage + _stat(where / "memory.stat").get(inactive_key, 0)
    return None


def _stat(path: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines() if line.count(" ") == 1)}
    except (OSError, ValueError):
        return {}
