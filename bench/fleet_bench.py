#!/usr/bin/env python3
"""Two mindserve replicas behind a gateway, a multi-tenant prefix workload: what prompt-aware routing is worth.

Each tenant has its own shared prefix (a system prompt or document, ``--prefix-tokens`` tokens); the tenants'
prefixes together exceed one replica's prefix cache but fit the fleet's. ``--rounds`` rounds, in each every
tenant asks one new question (a random order), ``--clients`` clients at a time, streamed, ``--max-tokens``
tokens each. Four runs, each on freshly started replicas (empty caches), from deploy/fleet/fleet.py:

  smg-cache_aware   /v1/completions through SMG --policy cache_aware
  smg-round_robin   /v1/completions through SMG --policy round_robin
  haproxy-affinity  POST / through deploy/haproxy/haproxy-affinity.cfg (the prompt's leading bytes stick to the
                    replica that answered them; a new prefix goes to the least loaded replica)
  haproxy-blind     POST / through deploy/haproxy/haproxy.cfg (leastconn: blind to the prompt)

Per run: prompt tokens found in the replicas' prefix caches (GET /info ``prefix_cache.hit_tokens``, after
minus before) over all prompt tokens sent, TTFT p50/p95 (send to the first streamed token), failures. The
bars of issue 39: aware/blind hit tokens >= 1.8x and TTFT p50 <= 0.6x, for SMG and for HAProxy. On a shared
machine one run is noisy: ``--repeat N`` runs the list N times, alternating, and the ratios are of the medians.

    python bench/fleet_bench.py --json bench/results/fleet-$(date +%F).json
    python bench/fleet_bench.py --runs haproxy-affinity haproxy-blind --repeat 3 --json ...
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
RUNS = ("smg-cache_aware", "smg-round_robin", "haproxy-affinity", "haproxy-blind")
BARS = {"hits": 1.8, "ttft_p50": 0.6}
WORDS = ("account answer archive balance border budget cable camera carbon channel circuit climate column comfort "
         "contract copper corner cotton credit custom danger debate degree desert detail device diesel dinner "
         "doctor dollar domain editor effort engine estate export fabric factor falcon family farmer figure "
         "filter finger forest formal frozen future garden gather genius glance golden gravel guitar harbor "
         "hazard heater hollow island jacket jungle kettle ladder launch lawyer leader legend lesson letter "
         "liquid lumber magnet manner marble margin market meadow member mirror module motion museum narrow "
         "nickel notice number object office orange oxygen paddle parcel parish patrol pencil pepper permit "
         "planet pocket poetry potato powder prince profit public puzzle rabbit random reason record region "
         "remedy rescue ribbon rocket saddle salmon sample season second secret senate shadow signal silver "
         "sketch socket spirit spring square statue stereo stream street studio summit supply switch symbol "
         "tablet talent target tenant thread ticket timber tissue tongue tunnel turkey unique valley velvet "
         "vessel violin volume wallet window winter wisdom wonder yellow").split()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fleet_module():
    """deploy/fleet/fleet.py (deploy/ is not a package): the one way to start replicas and the gateway."""
    spec = importlib.util.spec_from_file_location("mindserve_deploy_fleet", REPO / "deploy" / "fleet" / "fleet.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_ports(n: int) -> list[int]:
    import socket
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


# ---- the workload ---------------------------------------------------------------------------------------------

def token_count(url: str, text: str) -> int:
    reply = requests.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
    reply.raise_for_status()
    return reply.json()["count"]


def tenant_prefixes(url: str, tenants: int, tokens: int, seed: int) -> list[str]:
    """One prefix per tenant of at least ``tokens`` tokens (counted by the replica's tokenizer): seeded words,
    each tenant's first line naming it, so no two share more than a few leading tokens."""
    rng = random.Random(seed)
    prefixes = []
    for t in range(tenants):
        words = [rng.choice(WORDS) for _ in range(tokens)]
        head = f"Tenant {t} ({rng.randrange(10**6):06d}) reference document. "
        n = int(tokens * 0.8)
        while token_count(url, head + " ".join(words[:n])) < tokens:
            n += 16
        prefixes.append(head + " ".join(words[:n]) + "\n")
    return prefixes


def schedule(prefixes: list[str], rounds: int, seed: int) -> list[tuple[int, int, str]]:
    """(round, tenant, prompt) in sending order: each round every tenant once, a random order per round."""
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        for t in rng.sample(range(len(prefixes)), len(prefixes)):
            question = f"Question {r}.{t}: which word follows '{rng.choice(WORDS)}' the first time?"
            out.append((r, t, prefixes[t] + question))
    return out


def first_token(reply: requests.Response, tgi: bool) -> tuple[float | None, str]:
    """Read a streamed reply to its end; the monotonic time of its first token, and an error ("" if none)."""
    first, error, done = None, "", False
    for line in reply.iter_lines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            continue
        event = json.loads(payload)
        if "error" in event:
            error = str(event["error"])[:200]
            continue
        got = event.get("token", {}).get("text") if tgi else (event.get("choices") or [{}])[0].get("text")
        if first is None and got:
            first = time.monotonic()
        if tgi and event.get("generated_text") is not None:
            done = True
    if not done and not error:
        error = "the stream ended without its last event"
    return first, error


def one_request(url: str, prompt: str, route: str, max_tokens: int, model: str) -> dict:
    tgi = route == "/"
    body = ({"inputs": prompt, "stream": True, "parameters": {"max_new_tokens": max_tokens, "do_sample": False}}
            if tgi else {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "stream": True})
    sent = time.monotonic()
    try:
        with requests.post(url + route, json=body, stream=True, timeout=600) as reply:
            if reply.status_code != 200:
                return {"ok": False, "error": f"{reply.status_code} {reply.text[:200]}"}
            replica = reply.headers.get("X-Mindserve-Replica")
            first, error = first_token(reply, tgi)
    except requests.RequestException as exc:
        return {"ok": False, "error": repr(exc)[:200]}
    ended = time.monotonic()
    if error or first is None:
        return {"ok": False, "error": error or "no token"}
    return {"ok": True, "ttft": first - sent, "e2e": ended - sent, "replica": replica}


def drive(url: str, work: list[tuple[int, int, str]], route: str, clients: int, max_tokens: int,
          model: str) -> list[dict]:
    """``clients`` threads take the next request of ``work`` in order until none is left."""
    todo: queue.Queue = queue.Queue()
    for item in work:
        todo.put(item)
    results: list[dict] = []

    def client() -> None:
        while True:
            try:
                r, t, prompt = todo.get_nowait()
            except queue.Empty:
                return
            results.append({"round": r, "tenant": t, **one_request(url, prompt, route, max_tokens, model)})

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


# ---- the runs -------------------------------------------------------------------------------------------------

def hit_tokens(replica_urls: list[str]) -> list[int]:
    return [requests.get(u + "/info", timeout=30).json()["mindserve"]["prefix_cache"]["hit_tokens"] or 0
            for u in replica_urls]


def cache_tokens(url: str) -> int:
    info = requests.get(url + "/info", timeout=30).json()["mindserve"]
    return info["cache_blocks_total"] * info["cache_block_size"]


class HAProxy:
    """``haproxy -db -f deploy/haproxy/<config>`` in front of the replicas (their /health on the business port)."""

    def __init__(self, config: str, listen: int, replica_urls: list[str], log_dir: Path) -> None:
        binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        env = {**os.environ, "MINDSERVE_LISTEN": f"127.0.0.1:{listen}",
               "MINDSERVE_ADMIN_SOCKET": str(log_dir / f"haproxy-{listen}.sock")}
        for i, url in enumerate(replica_urls, 1):
            hostport = url.split("//", 1)[1]
            env[f"MINDSERVE_R{i}"], env[f"MINDSERVE_R{i}_HEALTH"] = hostport, hostport.rsplit(":", 1)[1]
        self.log = (log_dir / f"haproxy-{listen}.log").open("wb")
        self.proc = subprocess.Popen([binary, "-db", "-f", str(REPO / "deploy" / "haproxy" / config)], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{listen}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # both replicas UP: two good checks each
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    time.sleep(3)
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError("HAProxy did not answer")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def run_one(name: str, args, fleet_mod, log_dir: Path, prefixes: list[str] | None) -> tuple[dict, list[str]]:
    """One run on fresh replicas (logs under ``log_dir``); its record, and the tenants' prefixes (made on the
    first run, reused by the others so every run sends the same prompts)."""
    kind, _, variant = name.partition("-")
    ports = free_ports(4)
    serve_args = ["--ctx-size", str(args.ctx_size), "--max-batch-size", str(args.max_batch_size)]
    fleet = fleet_mod.Fleet(2, ports=ports[:2], gateway=kind == "smg", gateway_port=ports[2],
                            prometheus_port=ports[3], policy=variant if kind == "smg" else "round_robin",
                            serve_args=serve_args, log_dir=log_dir, ready_timeout=600,
                            gateway_args=args.gateway_arg if kind == "smg" else ())
    log(f"{name}: starting 2 replicas{' and SMG' if kind == 'smg' else ''}")
    fleet.start()
    proxy = None
    try:
        if prefixes is None:
            prefixes = tenant_prefixes(fleet.replica_urls[0], args.tenants, args.prefix_tokens, args.seed)
        work = schedule(prefixes, args.rounds, args.seed + 1)
        prompt_tokens = sum(token_count(fleet.replica_urls[0], p) for _, _, p in work)
        per_replica_cache = cache_tokens(fleet.replica_urls[0])
        model = requests.get(fleet.replica_urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
        if kind == "smg":
            url, route = fleet.gateway_url, "/v1/completions"
        else:
            proxy = HAProxy("haproxy-affinity.cfg" if variant == "affinity" else "haproxy.cfg", free_ports(1)[0],
                            fleet.replica_urls, log_dir)
            url, route = proxy.url, "/"
        before = hit_tokens(fleet.replica_urls)
        load0 = os.getloadavg()
        log(f"{name}: {len(work)} requests, {args.clients} clients, {route} via {url}; load {load0[0]:.2f}")
        started = time.monotonic()
        results = drive(url, work, route, args.clients, args.max_tokens, model)
        seconds = time.monotonic() - started
        after = hit_tokens(fleet.replica_urls)
        load1 = os.getloadavg()
    finally:
        if proxy is not None:
            proxy.stop()
        fleet.stop()
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] for r in ok)
    hits = sum(a - b for a, b in zip(after, before))
    record = {
        "route": route, "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "prompt_tokens": prompt_tokens, "hit_tokens": hits, "hit_ratio": round(hits / prompt_tokens, 4),
        "hit_tokens_by_replica": [a - b for a, b in zip(after, before)],
        "ttft_p50": round(statistics.median(ttfts), 4) if ttfts else None,
        "ttft_p95": round(ttfts[int(0.95 * (len(ttfts) - 1))], 4) if ttfts else None,
        "ttft_p50_by_round": {r: round(statistics.median(sorted(x["ttft"] for x in ok if x["round"] == r)), 4)
                              for r in range(args.rounds) if any(x["round"] == r for x in ok)},
        # HAProxy names the replica that answered (X-Mindserve-Replica); SMG does not
        "tenants_on_several_replicas": tenants_split(ok),
        "tenants_by_replica": tenants_by_replica(ok),
        "seconds": round(seconds, 1), "per_replica_cache_tokens": per_replica_cache,
        "load_avg_start": [round(x, 2) for x in load0], "load_avg_end": [round(x, 2) for x in load1],
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }
    log(f"{name}: {json.dumps(record)}")
    return record, prefixes


def tenants_split(ok: list[dict]) -> int | None:
    """How many tenants were answered by more than one replica (None: the route does not say which)."""
    seen: dict[int, set] = {}
    for r in ok:
        if r.get("replica") is None:
            return None
        seen.setdefault(r["tenant"], set()).add(r["replica"])
    return sum(len(replicas) > 1 for replicas in seen.values())


def tenants_by_replica(ok: list[dict]) -> dict[str, int] | None:
    """Replica → how many tenants it answered (None: the route does not say which)."""
    if any(r.get("replica") is None for r in ok):
        return None
    out: dict[str, set] = {}
    for r in ok:
        out.setdefault(r["replica"], set()).add(r["tenant"])
    return {replica: len(tenants) for replica, tenants in sorted(out.items())}


def median_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r[key] is not None]
    return statistics.median(values) if values else None


def ratio(aware: float | None, blind: float | None) -> float | None:
    return round(aware / blind, 3) if aware is not None and blind else None


def ratios(runs: dict[str, list[dict]]) -> dict:
    """Per aware/blind pair: the ratios of the medians over the repeats (the bars' test), and each repeat's own."""
    out = {}
    for aware, blind in (("smg-cache_aware", "smg-round_robin"), ("haproxy-affinity", "haproxy-blind")):
        if aware in runs and blind in runs:
            a, b = runs[aware], runs[blind]
            hits = ratio(median_of(a, "hit_tokens"), median_of(b, "hit_tokens"))
            ttft = ratio(median_of(a, "ttft_p50"), median_of(b, "ttft_p50"))
            out[f"{aware} / {blind}"] = {
                "repeats": min(len(a), len(b)), "hits": hits, "ttft_p50": ttft,
                "each_repeat": [{"hits": ratio(x["hit_tokens"], y["hit_tokens"]),
                                 "ttft_p50": ratio(x["ttft_p50"], y["ttft_p50"])} for x, y in zip(a, b)],
                "bars_met": hits is not None and hits >= BARS["hits"] and ttft is not None
                and ttft <= BARS["ttft_p50"] and all(r["failed"] == 0 for r in a + b)}
    return out


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"cpu": model, "cpus": os.cpu_count(), "avx512": " avx512f" in flags, "avx2": " avx2" in flags,
            "commit": commit, "command": " ".join(sys.argv)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=40)
    p.add_argument("--prefix-tokens", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ctx-size", type=int, default=1024, help="each replica's --ctx-size (sizes its cache)")
    p.add_argument("--max-batch-size", type=int, default=16, help="each replica's --max-batch-size (cache size)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--repeat", type=int, default=1, help="run the list this many times, alternating")
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `smg launch` (repeat: --gateway-arg=--worker-wedge-secs "
                        "--gateway-arg=30)")
    p.add_argument("--json", type=Path, help="write the record here")
    args = p.parse_args(argv)
    fleet_mod = fleet_module()
    log_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
              "workload": {k: getattr(args, k) for k in ("tenants", "prefix_tokens", "rounds", "clients",
                                                         "max_tokens", "ctx_size", "max_batch_size", "seed", "repeat")},
              "runs": {}, "logs": str(log_dir)}
    prefixes = None
    for repeat in range(args.repeat):
        for name in args.runs:
            run, prefixes = run_one(name, args, fleet_mod, log_dir / f"{name}-{repeat}", prefixes)
            record["runs"].setdefault(name, []).append(run)
            record["ratios"] = ratios(record["runs"])
            if args.json:
                args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["ratios"], indent=1))
    first = next(iter(record["runs"].values()))[0]
    log(f"tenants' prefixes: {args.tenants} x >= {args.prefix_tokens} tokens; one replica's cache "
        f"{first['per_replica_cache_tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
