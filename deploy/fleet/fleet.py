#!/usr/bin/env python3
"""A fleet on one machine: N ``mindserve serve`` replicas, each pinned to its share of the cores (``taskset`` and
``--threads``), and optionally the Shepherd Model Gateway (``smg launch``) in front of them. Prints the URLs once
everything answers, and stops everything cleanly (gateway first, then each replica drains) on Ctrl-C or SIGTERM.

    python deploy/fleet/fleet.py --replicas 2 --policy cache_aware -- --ctx-size 1024
    python deploy/fleet/fleet.py --replicas 0 --worker-url http://10.0.0.5:1025 --worker-url http://10.0.0.6:1025

Everything after ``--`` goes to each ``mindserve serve`` (a MODEL, --ctx-size, --config ...). ``Fleet`` is the same
thing as a context manager for scripts and tests (tests/support/fleet.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "prefix_hash",
            "consistent_hashing")
SMG_VERSION = "1.13.0"  # the version the contract tests ran against (setup.cfg extra "gateway")


def split_cores(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Each of ``n`` replicas' CPUs: contiguous, even shares (the first replicas take the remainder); with more
    replicas than CPUs, one CPU each, round robin (replicas then share cores)."""
    cpus = sorted(cpus)
    if n <= 0:
        return []
    if n > len(cpus):
        return [(cpus[i % len(cpus)],) for i in range(n)]
    share, extra = divmod(len(cpus), n)
    shares, start = [], 0
    for i in range(n):
        size = share + (1 if i < extra else 0)
        shares.append(tuple(cpus[start:start + size]))
        start += size
    return shares


def find_smg() -> str | None:
    """The ``smg`` binary: on PATH, or beside this Python (a venv's bin/)."""
    return shutil.which("smg") or shutil.which("smg", path=str(Path(sys.executable).parent))


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of GET url (None: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def http_json(url: str, timeout: float = 2.0) -> object | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


@dataclass
class Member:
    """One process of the fleet: its name, URL, command and log file."""

    name: str
    url: str
    cmd: list[str]
    log_path: Path
    cpus: tuple[int, ...] = ()
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, cwd: Path | None) -> None:
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(self.cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         start_new_session=True)  # Ctrl-C reaches the launcher only
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Fleet:
    """N replicas (127.0.0.1 or ``host``, ports ``ports`` or ``base_port``, ``base_port`` + 1, ...) and, unless
    ``gateway`` is False, SMG on ``gateway_port`` routing to them plus any ``worker_urls`` (replicas on other
    hosts). ``serve_args`` go to every replica, ``replica_args[i]`` to replica i only (after them). ``start()``
    returns once every replica's /health is 200 and the gateway lists them all."""

    def __init__(self, replicas: int = 2, *, host: str = "127.0.0.1", ports: Sequence[int] | None = None,
                 base_port: int = 8001, serve_args: Sequence[str] = (), cpus: Sequence[int] | None = None,
                 gateway: bool = True, gateway_port: int = 8000, policy: str = "cache_aware",
                 gateway_args: Sequence[str] = (), prometheus_port: int | None = None,
                 worker_urls: Sequence[str] = (), log_dir: Path | None = None,
                 replica_cmd: Sequence[str] | None = None, replica_args: Sequence[Sequence[str]] = (),
                 smg: str | None = None, ready_timeout: float = 600.0, grace: float = 40.0) -> None:
        ports = list(ports) if ports is not None else [base_port + i for i in range(replicas)]
        if len(ports) != replicas:
            raise ValueError(f"{replicas} replicas need {replicas} ports, got {ports}")
        self.host = host
        self.ready_timeout = ready_timeout
        self.grace = grace
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mindserve-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base_cmd = list(replica_cmd) if replica_cmd else [sys.executable, "-m", "service"]
        shares = split_cores(cpus if cpus is not None else sorted(os.sched_getaffinity(0)), replicas)
        own = list(replica_args) + [()] * (replicas - len(replica_args))  # replica i's extra serve args
        self.replicas = [
            Member(f"replica{i}", f"http://{_url_host(host)}:{port}",
                   ["taskset", "-c", ",".join(map(str, share)), *base_cmd, "serve", "--host", host,
                    "--port", str(port), "--threads", str(len(share)), *serve_args, *own[i]],
                   self.log_dir / f"replica{i}.log", share)
            for i, (port, share) in enumerate(zip(ports, shares))]
        self.worker_urls = [r.url for r in self.replicas] + list(worker_urls)
        self.gateway: Member | None = None
        if gateway:
            binary = smg or find_smg()
            if binary is None:
                raise FileNotFoundError("smg is not installed: pip install 'mindserve[gateway]' (smg==%s)"
                                        % SMG_VERSION)
            self.gateway = Member(
                "gateway", f"http://{_url_host(host)}:{gateway_port}",
                [binary, "launch", "--host", host, "--port", str(gateway_port), "--policy", policy,
                 "--prometheus-host", host, "--prometheus-port", str(prometheus_port or gateway_port + 1000),
                 "--worker-urls", *self.worker_urls, *gateway_args],
                self.log_dir / "gateway.log")

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def gateway_url(self) -> str | None:
        return self.gateway.url if self.gateway else None

    @property
    def members(self) -> list[Member]:
        return [*self.replicas, *([self.gateway] if self.gateway else [])]

    def start(self) -> Fleet:
        cwd = REPO if (REPO / "service").is_dir() else None
        try:
            for replica in self.replicas:
                replica.start(cwd)
            self._wait(self.replicas, lambda m: http_status(m.url + "/health") == 200, "/health 200")
            if self.gateway:
                self.gateway.start(None)
                self._wait([self.gateway], lambda m: self._gateway_ready(), "every worker registered")
        except BaseException:
            self.stop()
            raise
        return self

    def _gateway_ready(self) -> bool:
        """SMG answers /workers and lists every worker URL we gave it."""
        listing = http_json(self.gateway.url + "/workers")
        if not isinstance(listing, dict):
            return False
        urls = {w.get("url", "").rstrip("/") for w in listing.get("workers", []) if isinstance(w, dict)}
        return all(u.rstrip("/") in urls for u in self.worker_urls)

    def _wait(self, members: list[Member], ready, what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout
        pending = list(members)
        while pending:
            for m in list(pending):
                if not m.alive():
                    raise RuntimeError(f"{m.name} exited ({m.proc.returncode}); {m.log_path}:\n{m.log_tail()}")
                if ready(m):
                    pending.remove(m)
            if pending and time.monotonic() > deadline:
                names = ", ".join(m.name for m in pending)
                raise TimeoutError(f"{names}: no {what} in {self.ready_timeout:.0f} s; logs in {self.log_dir}")
            if pending:
                time.sleep(0.5)

    def stop(self) -> None:
        """The gateway first (no new requests), then SIGTERM to every replica: each drains for its
        shutdownGracePeriod; whatever is still running after ``grace`` seconds is killed."""
        if self.gateway:
            self.gateway.signal(signal.SIGTERM)
            if self.gateway.wait(10) is None:
                self.gateway.signal(signal.SIGKILL)
                self.gateway.wait(10)
        for replica in self.replicas:
            replica.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for replica in self.replicas:
            if replica.wait(max(0.1, deadline - time.monotonic())) is None:
                replica.signal(signal.SIGKILL)
                replica.wait(10)

    def describe(self) -> dict:
        """What ``--json`` prints: the URLs, each replica's CPUs and the logs."""
        return {"gateway": self.gateway_url, "replicas": [{"url": r.url, "cpus": list(r.cpus),
                                                           "log": str(r.log_path)} for r in self.replicas],
                "workers": self.worker_urls, "log_dir": str(self.log_dir)}

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _url_host(host: str) -> str:
    """The host part of a URL for a listen address (0.0.0.0 is reached as 127.0.0.1; IPv6 in brackets)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    serve_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to every `mindserve serve`.")
    p.add_argument("--replicas", "-n", type=int, default=2, help="mindserve replicas on this machine (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="listen address of replicas and gateway (default 127.0.0.1)")
    p.add_argument("--base-port", type=int, default=8001, help="first replica's port; the next ones follow (8001)")
    p.add_argument("--cpus", help="CPUs to share out, e.g. 0-3 or 0,2 (default: the CPUs this process may use)")
    p.add_argument("--no-gateway", action="store_true", help="replicas only")
    p.add_argument("--gateway-port", type=int, default=8000, help="the gateway's port (default 8000)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="SMG routing policy (cache_aware)")
    p.add_argument("--prometheus-port", type=int, help="SMG's own metrics port (default: gateway port + 1000)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `smg launch` (repeat: --gateway-arg=--load-monitor-interval "
                        "--gateway-arg=1)")
    p.add_argument("--worker-url", action="append", default=[], metavar="URL",
                   help="a replica already running elsewhere (another host), routed to as well")
    p.add_argument("--smg", help="the smg binary (default: smg on PATH or beside this Python)")
    p.add_argument("--log-dir", type=Path, help="where each process logs (default: a new temporary directory)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness (600)")
    p.add_argument("--json", action="store_true", help="print the URLs as one JSON line")
    args = p.parse_args(argv)
    args.serve_args = serve_args
    return args


def parse_cpus(text: str) -> list[int]:
    """``0-3,6`` -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fleet = Fleet(args.replicas, host=args.host, base_port=args.base_port, serve_args=args.serve_args,
                  cpus=parse_cpus(args.cpus) if args.cpus else None, gateway=not args.no_gateway,
                  gateway_port=args.gateway_port, policy=args.policy, gateway_args=args.gateway_arg,
                  prometheus_port=args.prometheus_port, worker_urls=args.worker_url, log_dir=args.log_dir,
                  smg=args.smg, ready_timeout=args.ready_timeout)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet.start()
    if args.json:
        print(json.dumps(fleet.describe()), flush=True)
    else:
        for r in fleet.replicas:
            print(f"replica  {r.url}  cpus {','.join(map(str, r.cpus))}  log {r.log_path}")
        for url in args.worker_url:
            print(f"worker   {url}  (remote)")
        if fleet.gateway:
            print(f"gateway  {fleet.gateway_url}  smg --policy {args.policy}  log {fleet.gateway.log_path}")
        print("Ctrl-C stops the fleet.", flush=True)
    try:
        while not stop.is_set():
            gone = [m for m in fleet.members if not m.alive()]
            if gone:
                print(f"{gone[0].name} exited ({gone[0].proc.returncode}); stopping the fleet", file=sys.stderr)
                return_code = 1
                break
            stop.wait(1.0)
        else:
            return_code = 0
    finally:
        fleet.stop()
    return return_code


if __name__ == "__main__":
    sys.exit(main())
