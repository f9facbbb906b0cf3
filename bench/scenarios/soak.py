"""Soak: many concurrent clients against ``mindserve serve`` on the default model for N minutes.

    .venv/bin/python -m bench soak [--minutes 10] [--clients 64] [--max-link-num N] [--json OUT.json] [--save]
    .venv/bin/python -m bench soak --flood-only [--flood 300] [--flood-header-only 600] [--repo CHECKOUT]

Starts the server itself (a copy of configs/server.yaml on a free port, the converted default model
of ``.cache/models``), drives it with ``--clients`` asyncio clients (aiohttp) for ``--minutes``, then
stops it with SIGTERM. Each client loops over a fixed, seeded mix of requests:

* 50 % ``POST /`` streams, 20 % ``POST /generate``, 10 % ``POST /v1/chat/completions`` (8-48 new tokens);
* 10 % invalid bodies (a 422 is the right answer);
* 10 % streams the client drops after the first event (the server must cancel them).

It reports requests sent, completed, rejected (429) and dropped, errors by status and transport
errors, which must add up to the number sent; the server's own counters (``/metrics``) must agree;
after the run the engine must hold no request, slot or cache block (``/info``); and the server's RSS
at the start (after warm-up) and at the end, which should stay within 10 %. Not part of the tests.

The slow-client flood (issue 15; ``--flood N``, off by default; after the mixed soak, or alone with
``--flood-only``): N raw asyncio sockets send a whole ``POST /`` head with ``Content-Length: 1000``, then one
body byte every ``--flood-interval`` (5) s; ``--flood-header-only M`` more send the same head and nothing
else. For ``--flood-seconds`` (90) a normal request (``POST /``, greedy, 16 new tokens) is sent one after
another (1 s apart, each with a ``--normal-timeout`` of 60 s) and ``/health`` and ``/info`` are probed every
2 s (with the server's own count of its established TCP connections, from psutil, as the truth to compare
the gauges with). Then the flood sockets still open are closed and the script reports the normal requests'
statuses and latency, the gauges seen, how each flood socket ended (a status the server answered, a close
or reset by the server, or still open when the flood was closed; and when) and the server's
``http_timeouts_total`` / ``http_refused_total``. It stops by itself: the flood is held ``--flood-seconds``,
the normal request then in progress gets at most ``--normal-timeout``, and the whole phase is cut off at
``--flood-seconds`` + 3 × ``--normal-timeout`` + 120 s whatever happens.

``--repo DIR`` runs another checkout's server (``python -m service serve`` with the working directory and
``PYTHONPATH`` set to DIR, its ``configs/server.yaml`` as the base config) with this script, e.g. a worktree of
the commit before a fix; ``--set KEY=VALUE`` sets a ``ServerConfig`` key in the generated config.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import yaml

from bench import harness
from bench.harness.machine import commit
from bench.harness.paths import MODEL_DIR, REPO
from bench.harness.server import free_port, serve_command, serve_env
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright when it moves.",
    "List three reasons to learn a second language.",
    "The recipe for a simple tomato soup starts with",
    "Describe the view from the top of a mountain at sunrise.",
    "What is the difference between weather and climate?",
    "Once upon a time, in a village by the sea,",
    "Give advice to someone starting their first job.",
]
MIX = (("stream", 50), ("text", 20), ("chat", 10), ("invalid", 10), ("drop", 10))
RSS_FLAT = 0.10


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    rejected: int = 0  # 429
    dropped: int = 0  # the client hung up on purpose
    errors_by_status: Counter = field(default_factory=Counter)  # any other status (422 expected for "invalid")
    transport_errors: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    tokens: int = 0

    def accounted(self) -> int:
        return (self.completed + self.rejected + self.dropped + sum(self.errors_by_status.values())
                + sum(self.transport_errors.values()))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


# --- the server ---------------------------------------------------------------------------------------------

def write_config(workdir: Path, base: Path, model_dir: Path, max_link_num: int | None,
                 overrides: dict | None = None) -> Path:
    cfg = yaml.safe_load(base.read_text())
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(model_dir)
    if max_link_num is not None:
        cfg["ServerConfig"]["maxLinkNum"] = max_link_num
    cfg["ServerConfig"].update(overrides or {})
    path = workdir / "soak.yaml"
    path.write_text(f"# generated by python -m bench soak from {base}\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def start_server(config: Path, port: int, log_path: Path, repo: Path = REPO) -> subprocess.Popen:
    """``repo``'s server (another checkout: its own service/ and backends/ first on the path)."""
    cmd = serve_command(config, port)
    log(f"starting: {' '.join(cmd)} (cwd {repo}; log: {log_path})")
    return subprocess.Popen(cmd, cwd=repo, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env=serve_env(repo, {"PYTHONUNBUFFERED": "1"}), start_new_session=True)


async def wait_ready(session: aiohttp.ClientSession, base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} while starting")
        try:
            async with session.get(base + "/health") as reply:
                if reply.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1.0)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


# --- the clients -------------------------------------------------------------------------------------------

def pick_kind(rng: random.Random) -> str:
    return rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX])[0]


def request_for(kind: str, rng: random.Random, model: str) -> tuple[str, dict]:
    prompt, max_new = rng.choice(PROMPTS), rng.randint(8, 48)
    if kind == "chat":
        return "/v1/chat/completions", {"model": model, "max_tokens": max_new,
                                        "messages": [{"role": "user", "content": prompt}]}
    if kind == "invalid":
        return "/", {"inputs": prompt, "parameters": {"top_p": 1.5, "max_new_tokens": max_new}}
    return ("/generate" if kind == "text" else "/"), {
        "inputs": prompt, "stream": kind in ("stream", "drop"),
        "parameters": {"max_new_tokens": max_new, "do_sample": rng.random() < 0.5, "seed": rng.randint(1, 10**9)}}


async def one_request(session: aiohttp.ClientSession, base: str, kind: str, rng: random.Random, tally: Tally,
                      model: str) -> None:
    path, body = request_for(kind, rng, model)
    tally.sent += 1
    tally.by_kind[kind] += 1
    try:
        async with session.post(base + path, json=body) as reply:
            if reply.status == 429:
                await reply.read()
                tally.rejected += 1
                await asyncio.sleep(rng.uniform(0.05, 0.3))  # back off
                return
            if reply.status != 200:
                await reply.read()
                tally.errors_by_status[reply.status] += 1
                return
            if kind == "drop":
                await reply.content.readuntil(b"\n\n")
                reply.close()  # hang up mid-stream
                tally.dropped += 1
                return
            if kind == "stream":
                ok, tokens = await read_stream(reply)
            else:
                data = await reply.json()
                ok, tokens = True, len((data.get("generated_text") or data.get("choices", [{}])[0]
                                        .get("message", {}).get("content") or "").split())
            if ok:
                tally.completed += 1
                tally.tokens += tokens
            else:
                tally.errors_by_status["200+error event"] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        tally.transport_errors[type(exc).__name__] += 1


async def read_stream(reply: aiohttp.ClientResponse) -> tuple[bool, int]:
    """(ended with generated_text and no error event, token events)."""
    tokens, ended = 0, False
    async for line in reply.content:
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return False, tokens
        tokens += 1
        ended = event.get("generated_text") is not None
    return ended, tokens


async def client(session: aiohttp.ClientSession, base: str, seed: int, until: float, tally: Tally,
                 model: str) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        await one_request(session, base, pick_kind(rng), rng, tally, model)


async def sample_rss(proc: psutil.Process, samples: list[tuple[float, int]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic(), tree_rss(proc)))
        try:
            await asyncio.wait_for(stop.wait(), 5.0)
        except asyncio.TimeoutError:
            pass


# --- the slow-client flood (issue 15) ------------------------------------------------------------------

FLOOD_BODY_BYTES = 1000  # the Content-Length every flood socket declares
# greedy, 16 new tokens (this prompt does not end on EOS before them: PROMPTS[0] does, after 1 token)
NORMAL_BODY = {"inputs": PROMPTS[6], "parameters": {"max_new_tokens": 16, "do_sample": False, "details": True}}
PROBE_SECONDS = 2.0
CONNECT_AT_ONCE = 64  # flood connects in flight at once (the old server's listen backlog was 128)


@dataclass
class FloodSocket:
    kind: str  # "body": trickles its body; "head": sends its head and nothing else
    connected: bool = False
    body_bytes: int = 0
    outcome: str = "?"  # "408"/"429"/...: the server answered; "closed"/"reset": the server hung up without
    at: float | None = None  # an answer; "held": still open when the flood was closed; "connect: X": no socket


def flood_head(host: str, port: int) -> bytes:
    return (f"POST / HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {FLOOD_BODY_BYTES}\r\n\r\n").encode()


async def flood_socket(sock: FloodSocket, host: str, port: int, t0: float, stop: asyncio.Event,
                       interval: float, connecting: asyncio.Semaphore) -> None:
    """One attacker: connect, send the head, then (``body``) one body byte every ``interval`` s, until the
    server answers or hangs up, or ``stop`` is set."""
    try:
        async with connecting:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 15.0)
            writer.write(flood_head(host, port))
            await writer.drain()
    except (OSError, asyncio.TimeoutError) as exc:
        sock.outcome = f"connect: {type(exc).__name__}"
        return
    sock.connected = True
    answer = asyncio.ensure_future(reader.read(4096))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        next_byte = time.monotonic()
        while True:
            if sock.kind == "body" and time.monotonic() >= next_byte and sock.body_bytes < FLOOD_BODY_BYTES - 1:
                writer.write(b"{" if sock.body_bytes == 0 else b" ")  # never the whole body
                sock.body_bytes += 1
                next_byte += interval
            wait = max(next_byte - time.monotonic(), 0.01) if sock.kind == "body" else None
            await asyncio.wait({answer, stopping}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if answer.done():
                sock.at = time.monotonic() - t0
                try:
                    data = answer.result()
                except OSError:
                    sock.outcome = "reset"
                else:
                    match = re.match(rb"HTTP/1\.[01] (\d{3})", data)
                    sock.outcome = match.group(1).decode() if match else ("closed" if not data else "garbage")
                return
            if stopping.done():
                sock.outcome = "held"
                return
    finally:
        for task in (answer, stopping):
            task.cancel()
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 2.0)
        except (OSError, asyncio.TimeoutError):
            pass


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """{sample name: {"label=value,...": value}} of a Prometheus text scrape (model_name left out)."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in re.findall(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        key = ",".join(f"{k}={v}" for k, v in re.findall(r'(\w+)="([^"]*)"', labels) if k != "model_name")
        out.setdefault(name, {})[key] = float(value)
    return out


def server_tcp_connections(server: psutil.Process, port: int) -> int | None:
    """Established client connections the server process holds on ``port`` (the truth the gauges tell)."""
    try:
        return sum(1 for c in server.net_connections(kind="tcp")
                   if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)
    except psutil.Error:
        return None


async def probe(session: aiohttp.ClientSession, base: str, server: psutil.Process, port: int, t0: float) -> dict:
    """One look at the server: /health's status, /info's engine and http gauges, its TCP connections."""
    sample: dict = {"t": round(time.monotonic() - t0, 1)}
    timeout = aiohttp.ClientTimeout(total=5)
    try:
        async with session.get(base + "/health", timeout=timeout) as reply:
            sample["health"] = reply.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        sample["health"] = type(exc).__name__
    try:
        async with session.get(base + "/info", timeout=timeout) as reply:
            ms = (await reply.json())["mindserve"]
        sample.update(running=ms.get("running"), waiting=ms.get("waiting"))
        # slots_in_use, slots_total, waiting_for_slot, reading_body, open_connections
        sample.update(ms.get("http") or {})
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
        sample["info"] = type(exc).__name__
    sample["server_tcp"] = server_tcp_connections(server, port)
    return sample


async def normal_request(session: aiohttp.ClientSession, base: str, t0: float, timeout: float) -> dict:
    started = time.monotonic()
    record: dict = {"t": round(started - t0, 1)}
    try:
        async with session.post(base + "/", json=NORMAL_BODY, timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
            data = await reply.read()
            record["status"] = reply.status
        if reply.status == 200:
            record["tokens"] = json.loads(data)[0]["details"]["generated_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, LookupError) as exc:
        record["status"] = type(exc).__name__
    record["latency_s"] = round(time.monotonic() - started, 2)
    return record


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def flood(args: argparse.Namespace, base: str, proc: subprocess.Popen, session: aiohttp.ClientSession) -> dict:
    """The flood phase: baseline requests, the flood with normal requests and probes, the end of it."""
    host, port = "127.0.0.1", int(base.rsplit(":", 1)[1])
    server = psutil.Process(proc.pid)
    log_path = args.workdir / "server.log"
    t0 = time.monotonic()
    baseline = [await normal_request(session, base, t0, args.normal_timeout) for _ in range(3)]
    log(f"baseline normal requests: {[(r['status'], r['latency_s']) for r in baseline]}")
    async with session.get(base + "/metrics") as reply:
        metrics_before = parse_metrics(await reply.text())
    log_offset = log_path.stat().st_size
    sockets = [FloodSocket("body") for _ in range(args.flood)] + [FloodSocket("head")
                                                                   for _ in range(args.flood_header_only)]
    log(f"flood: {args.flood} slow-body sockets (1 byte / {args.flood_interval:g} s of {FLOOD_BODY_BYTES}), "
        f"{args.flood_header_only} header-only sockets, for {args.flood_seconds:g} s")
    stop, connecting = asyncio.Event(), asyncio.Semaphore(CONNECT_AT_ONCE)
    t0 = time.monotonic()
    attackers = [asyncio.ensure_future(flood_socket(s, host, port, t0, stop, args.flood_interval, connecting))
                 for s in sockets if s.kind == "body"]
    await asyncio.sleep(2.0)  # the body sockets get their heads in first, as in the issue
    attackers += [asyncio.ensure_future(flood_socket(s, host, port, t0, stop, args.flood_interval, connecting))
                  for s in sockets if s.kind == "head"]
    await asyncio.sleep(2.0)
    deadline = t0 + args.flood_seconds
    probes: list[dict] = []

    async def prober() -> None:
        while time.monotonic() < deadline:
            sample = await probe(session, base, server, port, t0)
            sample["flood_open"] = sum(1 for s in sockets if s.connected and s.outcome == "?")
            probes.append(sample)
            log(f"probe {sample}")
            await asyncio.sleep(max(0.0, PROBE_SECONDS - (time.monotonic() - t0 - sample["t"])))

    async def normals() -> list[dict]:
        records = []
        while time.monotonic() < deadline:
            record = await normal_request(session, base, t0, args.normal_timeout)
            record["flood_open_after"] = sum(1 for s in sockets if s.connected and s.outcome == "?")
            records.append(record)
            log(f"normal request {record}")
            await asyncio.sleep(1.0)
        return records

    probing = asyncio.ensure_future(prober())
    normal = asyncio.ensure_future(normals())
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    stop.set()  # close what is still open of the flood
    await asyncio.wait_for(asyncio.gather(*attackers), 30.0)
    closed_at = round(time.monotonic() - t0, 1)
    await probing
    records = await asyncio.wait_for(normal, args.normal_timeout + 15.0)
    log(f"flood closed at {closed_at} s")
    await asyncio.sleep(3.0)
    after = await normal_request(session, base, t0, args.normal_timeout)
    after_probe = await probe(session, base, server, port, t0)
    async with session.get(base + "/info") as reply:
        engine_after = (await reply.json())["mindserve"]
    async with session.get(base + "/metrics") as reply:
        metrics_after = parse_metrics(await reply.text())
    with log_path.open("rb") as f:
        f.seek(log_offset)
        logged = Counter(m.decode() for m in re.findall(rb"method=POST path=/ status=(\d+)", f.read()))

    def delta(name: str) -> dict[str, float]:
        return {key: value - metrics_before.get(name, {}).get(key, 0.0)
                for key, value in metrics_after.get(name, {}).items()}

    return {"baseline": baseline, "records": records, "probes": probes, "sockets": sockets, "closed_at": closed_at,
            "after_request": after, "after_probe": after_probe, "engine_after": engine_after,
            "timeouts": delta("http_timeouts_total"), "refused": delta("http_refused_total"),
            "received": delta("request_received_total"), "access_log_post_root": dict(logged)}


def flood_report(args: argparse.Namespace, out: dict) -> dict:
    records, probes = out["records"], out["probes"]
    ok = [r["latency_s"] for r in records if r["status"] == 200]
    outcomes: dict[str, dict] = {}
    for kind in ("body", "head"):
        group = [s for s in out["sockets"] if s.kind == kind]
        if not group:
            continue
        by = Counter(s.outcome for s in group)
        ended = {}
        for outcome in by:
            times = [s.at for s in group if s.outcome == outcome and s.at is not None]
            if times:
                ended[outcome] = (f"{by[outcome]} at {min(times):.1f}-{max(times):.1f} s "
                                  f"(median {percentile(times, .5):.1f})")
            else:
                ended[outcome] = str(by[outcome])
        outcomes[kind] = ended
    gauges = ("health", "running", "waiting", "slots_in_use", "waiting_for_slot", "reading_body", "open_connections",
              "server_tcp", "flood_open")
    seen = {g: sorted({p[g] for p in probes if g in p and p[g] is not None}, key=str) for g in gauges}
    seen = {g: (v if len(v) <= 6 else f"{v[0]}..{v[-1]} ({len(v)} values)") for g, v in seen.items() if v}
    engine = out["engine_after"]
    summary = {
        "flood_body_sockets": args.flood, "flood_header_only_sockets": args.flood_header_only,
        "flood_seconds": args.flood_seconds, "flood_closed_at_s": out["closed_at"],
        "baseline_normal": [(r["status"], r["latency_s"]) for r in out["baseline"]],
        "normal_sent": len(records),
        "normal_statuses": dict(Counter(str(r["status"]) for r in records)),
        "normal_200_latency_p50_s": percentile(ok, .5), "normal_200_latency_max_s": max(ok, default=None),
        "normal_latency_max_s": max((r["latency_s"] for r in records), default=None),
        "normal_200_tokens": dict(Counter(r.get("tokens") for r in records if r["status"] == 200)),
        "normal_first": records[0] if records else None,
        "normal_timeline": [(r["t"], r["status"], r["latency_s"]) for r in records],
        "flood_outcomes": outcomes,
        "gauges_seen": seen,
        "probes_first_mid_last": [probes[i] for i in sorted({0, len(probes) // 2, len(probes) - 1})] if probes else [],
        "http_timeouts_total_delta": out["timeouts"] or "not exported",
        "http_refused_total_delta": out["refused"] or "not exported",
        "request_received_total_delta": out["received"],
        "access_log_POST_root_statuses": out["access_log_post_root"],
        "after_flood_request": (out["after_request"]["status"], out["after_request"]["latency_s"]),
        "after_flood_probe": out["after_probe"],
        "engine_idle_after": engine.get("running") == 0 and engine.get("waiting") == 0
                             and engine.get("cache_blocks_free") == engine.get("cache_blocks_total"),
    }
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if key == "normal_timeline" and len(value) > 12:  # the whole of it is in --json
            value = f"{value[:6]} ... {value[-6:]} ({len(value)} requests: t s, status, latency s)"
        print(f"  {key:<{width}}  {value}")
    return summary


# --- the run -------------------------------------------------------------------------------------------

def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


async def run(args: argparse.Namespace, base: str, proc: subprocess.Popen) -> dict:
    """Start-up, warm-up, then the mixed soak (unless --flood-only) and the flood (with --flood)."""
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    out: dict = {}
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await wait_ready(session, base, proc, args.start_timeout)
        async with session.get(base + "/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        warm = Tally()
        for kind in ("stream", "text", "chat", "stream"):  # first requests allocate what stays allocated
            await one_request(session, base, kind, random.Random(0), warm, model)
        if not args.flood_only:
            out["soak"] = await soak(args, base, proc, session, model, warm)
    if args.flood:
        # its own session, one connection per request: no idle keep-alive connection of ours in the gauges
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
            out["flood"] = await asyncio.wait_for(
                flood(args, base, proc, session), args.flood_seconds + 3 * args.normal_timeout + 120)
    return out


async def soak(args: argparse.Namespace, base: str, proc: subprocess.Popen, session: aiohttp.ClientSession,
               model: str, warm: Tally) -> dict:
    server = psutil.Process(proc.pid)
    rss_start, samples, stop = tree_rss(server), [], asyncio.Event()
    sampler = asyncio.create_task(sample_rss(server, samples, stop))
    log(f"warm; RSS {rss_start / 2**20:.0f} MiB; {args.clients} clients for {args.minutes:g} min")
    tally, started = Tally(), time.monotonic()
    until = started + args.minutes * 60
    await asyncio.gather(*(client(session, base, 1000 + i, until, tally, model) for i in range(args.clients)))
    wall = time.monotonic() - started
    await asyncio.sleep(1.0)  # the last cancellations reach the engine
    rss_end = tree_rss(server)
    stop.set()
    await sampler
    async with session.get(base + "/info") as reply:
        engine = (await reply.json())["mindserve"]
    async with session.get(base + "/metrics") as reply:
        scrape = await reply.text()
    server_counts = {name: metric(scrape, f"request_{name}_total") - warm_part
                     for name, warm_part in (("received", warm.sent), ("success", warm.completed),
                                             ("failed", warm.sent - warm.completed))}
    return {"tally": tally, "wall_s": wall, "rss_start": rss_start, "rss_end": rss_end,
            "rss_max": max(r for _, r in samples), "engine_after": engine, "server_counts": server_counts}


def report(args: argparse.Namespace, out: dict, exit_code: int | None, loads: tuple) -> dict:
    t: Tally = out["tally"]
    mib = 2**20
    growth = out["rss_end"] / out["rss_start"] - 1
    engine = out["engine_after"]
    idle = engine["running"] == 0 and engine["waiting"] == 0 and engine["cache_blocks_free"] == engine[
        "cache_blocks_total"]
    server = out["server_counts"]
    summary = {
        "minutes": args.minutes, "clients": args.clients, "max_link_num": args.max_link_num,
        "wall_s": round(out["wall_s"], 1),
        "sent": t.sent, "completed": t.completed, "rejected_429": t.rejected, "dropped_by_client": t.dropped,
        "errors_by_status": {str(k): v for k, v in sorted(t.errors_by_status.items(), key=str)},
        "transport_errors": dict(t.transport_errors), "adds_up": t.accounted() == t.sent,
        "by_kind": dict(t.by_kind), "completed_per_s": round(t.completed / out["wall_s"], 2),
        "server_received": server["received"], "server_success": server["success"],
        "server_failed": server["failed"],
        # a dropped stream the server had already sent in full counts as a success there
        "server_agrees": server["received"] == t.sent and t.completed <= server["success"] <= t.completed + t.dropped
                         and server["received"] == server["success"] + server["failed"],
        "rss_start_mib": round(out["rss_start"] / mib, 1), "rss_end_mib": round(out["rss_end"] / mib, 1),
        "rss_max_mib": round(out["rss_max"] / mib, 1), "rss_growth_pct": round(100 * growth, 1),
        "rss_flat_within_10pct": abs(growth) <= RSS_FLAT,
        "engine_after": engine, "engine_idle_after": idle, "server_exit_code": exit_code,
        "load_average_start_end": loads,
    }
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        print(f"  {key:<{width}}  {value}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-link-num", type=int, default=None,
                        help="override ServerConfig.maxLinkNum (default: the config's, 300); below "
                             "clients/3 some requests get 429")
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="the checkout whose server is run (default: this one); another one is run as "
                             "`python -m service serve` with cwd and PYTHONPATH set to it")
    parser.add_argument("--config", type=Path, default=None,
                        help="base server config (default: REPO/configs/server.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="set ServerConfig.KEY (value read as YAML) in the generated config; repeatable")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mindserve-soak")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    harness.add_output_arguments(parser)
    flood_opts = parser.add_argument_group("slow-client flood (issue 15)")
    flood_opts.add_argument("--flood", type=int, nargs="?", const=300, default=0, metavar="N",
                            help="after the soak, N sockets send a POST / head (Content-Length 1000) and then "
                                 "one body byte every --flood-interval s (N default 300; off by default)")
    flood_opts.add_argument("--flood-header-only", type=int, default=0, metavar="M",
                            help="M more flood sockets send the same head and nothing else (default 0)")
    flood_opts.add_argument("--flood-only", action="store_true",
                            help="skip the mixed soak: start, warm up, flood (--flood 300 unless given)")
    flood_opts.add_argument("--flood-seconds", type=float, default=90.0,
                            help="how long the flood is held before the script closes it (default 90)")
    flood_opts.add_argument("--flood-interval", type=float, default=5.0, help="seconds between body bytes (5)")
    flood_opts.add_argument("--normal-timeout", type=float, default=60.0,
                            help="client timeout of each normal request during the flood (default 60 s)")
    args = parser.parse_args(argv)
    if args.flood_only and not args.flood:
        args.flood = 300
    args.repo = args.repo.resolve()
    if args.config is None:
        args.config = args.repo / "configs" / "server.yaml"
    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set wants KEY=VALUE, not {item!r}")
        overrides[key] = yaml.safe_load(value)
    if args.flood:  # a descriptor per flood socket, on both sides (the server inherits the limit)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 2 * (args.flood + args.flood_header_only) + 1024
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    args.workdir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    if load_start > 3:
        log(f"warning: load average {load_start:.1f} > 3: the machine is busy, numbers will be noisy")
    port = free_port()
    config = write_config(args.workdir, args.config, args.model_dir, args.max_link_num, overrides)
    proc = start_server(config, port, args.workdir / "server.log", args.repo)
    exit_code = None
    try:
        out = asyncio.run(run(args, f"http://127.0.0.1:{port}", proc))
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log("done")
    loads = (round(load_start, 2), round(os.getloadavg()[0], 2))
    summary: dict = {}
    good = exit_code == 0
    if "soak" in out:
        summary = report(args, out["soak"], exit_code, loads)
        good = good and summary["adds_up"] and summary["server_agrees"] and summary["engine_idle_after"]
    if "flood" in out:
        log(f"flood report ({args.repo}, git {commit(args.repo)}; server exit code {exit_code}; load {loads})")
        summary["flood"] = flood_report(args, out["flood"])
        good = good and summary["flood"]["engine_idle_after"]
    harness.save_results(args, "soak", summary)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
