"""Several models in one server: the RSS of a two-model server against each model served alone, and the
maxLoadedModels: 1 round trip (unload one model, load the other, answer) with the RSS after each swap.

    python -m bench multi-model MODEL_DIR_A MODEL_DIR_B [--port 18600] [--json OUT.json] [--save]

Each server is the real CLI (``mindserve serve --config``, started by ``bench.harness.server``) on the same small
config; RSS is the server process's VmRSS after a few requests to each model it serves (VmHWM: its peak). Prints
JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

from bench import harness
from bench.harness.server import start, wait_ready


def write_config(path: Path, port: int, models: list[tuple[str, Path]], max_loaded: int = 0) -> Path:
    path.write_text(yaml.safe_dump({
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": port},
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 1024, "maxInputTokenLen": 768, "maxLoadedModels": max_loaded,
                                  "ModelConfig": [{"modelName": n, "modelWeightPath": str(d), "npuMemSize": 0.25}
                                                  for n, d in models]},
            "ScheduleConfig": {"maxBatchSize": 16, "maxPrefillBatchSize": 8, "maxPrefillTokens": 64,
                               "maxIterTimes": 512, "cacheBlockSize": 128, "batchBuckets": [1, 2, 4, 8, 16]}}}))
    return path


def status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of ``pid`` in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


class Server:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.served = start(config, port=port, log_path=log)
        self.proc, self.url = self.served.proc, self.served.base
        wait_ready(self.served, 900)

    def complete(self, model: str, tokens: int = 16) -> float:
        started = time.perf_counter()
        reply = requests.post(self.url + "/v1/completions", json={"model": model, "prompt": "Once upon a time",
                                                                   "max_tokens": tokens, "temperature": 0},
                              timeout=900)
        reply.raise_for_status()
        return time.perf_counter() - started

    def stop(self) -> None:
        self.served.stop()
        self.log.close()


def alone_and_together(work: Path, port: int, models: list[tuple[str, Path]]) -> dict:
    out = {}
    for label, served in [(models[0][0], models[:1]), (models[1][0], models[1:]), ("both", models)]:
        server = Server(write_config(work / f"{label}.yaml", port, served), port, work / f"{label}.log")
        try:
            for name, _ in served:
                for _ in range(3):
                    server.complete(name)
            out[label] = status(server.proc.pid)
        finally:
            server.stop()
    out["sum_alone_rss"] = out[models[0][0]]["VmRSS"] + out[models[1][0]]["VmRSS"]
    out["both_over_sum"] = out["both"]["VmRSS"] / out["sum_alone_rss"]
    return out


def round_trips(work: Path, port: int, models: list[tuple[str, Path]], swaps: int = 4) -> dict:
    (a, _), (b, _) = models
    server = Server(write_config(work / "lru.yaml", port, models, max_loaded=1), port, work / "lru.log")
    try:
        warm = server.complete(a)
        rss = [status(server.proc.pid)["VmRSS"]]
        trips = []
        for i in range(swaps):
            trips.append(server.complete(b if i % 2 == 0 else a))  # unload the other, load this one, answer
            rss.append(status(server.proc.pid)["VmRSS"])
        info = requests.get(server.url + "/info", timeout=30).json()["mindserve"]["models"]
        return {"loaded_answer_seconds": warm, "swap_answer_seconds": trips, "rss_after_each_swap_mib": rss,
                "load_seconds": {m["name"]: m["last_load_seconds"] for m in info},
                "loads": {m["name"]: m["loads"] for m in info}, "unloads": {m["name"]: m["unloads"] for m in info}}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_a", type=Path)
    parser.add_argument("model_b", type=Path)
    parser.add_argument("--port", type=int, default=18600)
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    models = [("model-a", args.model_a.resolve()), ("model-b", args.model_b.resolve())]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {"rss_mib": alone_and_together(work, args.port, models),
                  "lru": round_trips(work, args.port, models)}
    print(json.dumps(result, indent=1))
    harness.save_results(args, "multi-model", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
