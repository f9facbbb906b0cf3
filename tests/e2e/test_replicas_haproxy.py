"""Two ``mindserve serve`` replicas behind HAProxy (deploy/haproxy/haproxy.cfg, as shipped): 32 clients keep
sending; one replica gets SIGTERM mid-run and is restarted. No request is lost: those in flight on the draining
replica finish there, new ones go to the other, and the restarted replica takes requests again once its
/health is 200.

The replicas run the tiny model with every decode step slowed (tests/support/served.py), so that requests take
long enough to be in flight when the signal comes. Every wait is bounded; the figures are printed (pytest -s)
and reported in docs/deploy.md.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from tests.support.cli import server_config
from tests.support.haproxy import HAPROXY, MISSING, HAProxy
from tests.support.http import free_ports, until
from tests.support.served import Served

pytestmark = pytest.mark.skipif(HAPROXY is None, reason=MISSING)

CLIENTS = 32
NEW_TOKENS = 12
SLOW_DECODE = 0.03       # s per decode step: a request takes about half a second on a replica
GRACE = 30               # shutdownGracePeriod of the replicas
WARM = 4.0               # s of load before the SIGTERM, and after the rejoin
REQUEST_TIMEOUT = 60
SIGNAL_MARGIN = 0.5      # s from the SIGTERM until the replica is surely refusing (its loop handles the signal)


@dataclass
class Outcome:
    client: int
    started: float
    ended: float
    status: int | None
    replica: str | None
    stream: bool
    ok: bool
    error: str = ""


def replica_config(tmp_path: Path, model_dir: Path, name: str, port: int, health_port: int) -> Path:
    cfg = server_config(model_dir, port=port, managementPort=health_port, shutdownGracePeriod=GRACE, maxLinkNum=32)
    cfg["BackendConfig"]["ScheduleConfig"].update(maxBatchSize=8, maxPrefillBatchSize=4, batchBuckets=[1, 2, 4, 8])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def one_request(session: requests.Session, url: str, client: int, n: int) -> Outcome:
    stream = (client + n) % 2 == 1
    body = {"inputs": f"client {client} request {n}", "stream": stream,
            "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False, "details": True}}
    started = time.monotonic()
    try:
        reply = session.post(url + "/", json=body, timeout=REQUEST_TIMEOUT, stream=stream)
        replica = reply.headers.get("X-Mindserve-Replica")
        if stream:
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith(b"data: ")]
            last = events[-1] if events else {}
            ok = (reply.status_code == 200 and "error" not in last and last.get("generated_text") is not None
                  and last["details"]["generated_tokens"] == len(events))
            detail = last
        else:
            detail = reply.json()
            ok = reply.status_code == 200 and detail[0]["details"]["generated_tokens"] >= 1
        return Outcome(client, started, time.monotonic(), reply.status_code, replica, stream, ok,
                       "" if ok else str(detail)[:300])
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        return Outcome(client, started, time.monotonic(), None, None, stream, False, repr(exc)[:300])


def drive(url: str, stop: threading.Event, outcomes: list[Outcome]) -> list[threading.Thread]:
    def client(i: int) -> None:
        with requests.Session() as session:
            n = 0
            while not stop.is_set():
                outcomes.append(one_request(session, url, i, n))
                n += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    return threads


def first_time(predicate, seconds: float, poll: float = 0.05) -> float | None:
    """The monotonic time ``predicate`` was first seen true, polling for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(poll)
    return None


def health(port: int) -> int | None:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
    except requests.RequestException:
        return None


def test_two_replicas_behind_haproxy_lose_no_request_through_a_sigterm_and_a_restart(tmp_path, tiny_model_dir):
    p1, h1, p2, h2, listen = free_ports(5)
    configs = {"r1": replica_config(tmp_path, tiny_model_dir, "r1", p1, h1),
               "r2": replica_config(tmp_path, tiny_model_dir, "r2", p2, h2)}
    replicas = {name: Served(path, slow_decode=SLOW_DECODE) for name, path in configs.items()}
    haproxy: HAProxy | None = None
    stop, outcomes, threads = threading.Event(), [], []
    try:
        for served in replicas.values():
            served.wait_url()
        haproxy = HAProxy(tmp_path, listen, {"r1": ("127.0.0.1", p1, h1), "r2": ("127.0.0.1", p2, h2)})
        assert until(lambda: haproxy.is_up("r1") and haproxy.is_up("r2"), 30, poll=0.1), haproxy.states()

        t0 = time.monotonic()
        threads = drive(haproxy.url, stop, outcomes)
        time.sleep(WARM)
        served_by_r1_before = sum(1 for o in list(outcomes) if o.replica == "r1")
        killed = time.monotonic()
        replicas["r1"].proc.send_signal(signal.SIGTERM)
        draining = first_time(lambda: health(h1) == 503, 5, poll=0.01)  # before the drain ends and the port closes
        down = first_time(lambda: not haproxy.is_up("r1"), 10)
        assert down is not None, haproxy.states()
        assert replicas["r1"].proc.wait(GRACE + 15) == 0, replicas["r1"].text()[-2000:]
        exited = time.monotonic()
        assert "Traceback" not in replicas["r1"].text()

        restarted = time.monotonic()
        replicas["r1"] = Served(configs["r1"], slow_decode=SLOW_DECODE)
        healthy = first_time(lambda: health(h1) == 200, 240)
        assert healthy is not None, replicas["r1"].text()[-3000:]
        up = first_time(lambda: haproxy.is_up("r1"), 30)
        assert up is not None, haproxy.states()
        time.sleep(WARM)
    finally:
        stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT + 5)
        for served in replicas.values():
            if served.proc.poll() is None:
                served.proc.send_signal(signal.SIGTERM)
        for served in replicas.values():
            try:
                served.proc.wait(GRACE + 15)
            except subprocess.TimeoutExpired:
                served.stop()
        if haproxy is not None:
            haproxy.stop()
    assert not any(t.is_alive() for t in threads)
    ended = time.monotonic()

    failed = [o for o in outcomes if not o.ok]
    assert served_by_r1_before > 0, "r1 served nothing before the SIGTERM"
    # In flight on r1 when the signal came: finished there, in full.
    drained = [o for o in outcomes if o.replica == "r1" and o.started < killed < o.ended and o.ended < exited]
    # Sent after r1 was seen draining and before it was back: all on r2 (the 503s HAProxy retried included).
    # (from when its /health was seen answering 503, or SIGNAL_MARGIN after the signal if that came sooner: a loaded
    # box may take longer than the margin to run the replica's signal handler)
    out_from = max(killed + SIGNAL_MARGIN, draining if draining is not None else killed)
    meanwhile = [o for o in outcomes if out_from < o.started and o.ended < up]
    rejoined = [o for o in outcomes if o.started > up and o.replica == "r1"]
    log = "".join(haproxy.log)
    # httplog's "actconn/feconn/beconn/srv_conn/retries" field: "+N" when the request was redispatched.
    redispatched = re.findall(r" \d+/\d+/\d+/\d+/\+[1-9]\d* ", log)
    figures = {
        "requests": len(outcomes), "ok": len(outcomes) - len(failed), "failed": len(failed),
        "by replica": {name: sum(1 for o in outcomes if o.replica == name) for name in ("r1", "r2")},
        "streams": sum(1 for o in outcomes if o.stream),
        "in flight on r1 at SIGTERM, finished there": len(drained),
        "sent while r1 was out": len(meanwhile),
        "served by r1 after it rejoined": len(rejoined),
        "r1's /health 503 after SIGTERM (s)": None if draining is None else round(draining - killed, 3),
        "r1 DOWN in HAProxy after SIGTERM (s)": round(down - killed, 2),
        "HAProxy's first failed check of r1": next(iter(re.findall(r"replicas/r1 failed, reason: ([^,]+)", log)), None),
        "drain: SIGTERM to exit (s)": round(exited - killed, 2),
        "restart to /health 200 (s)": round(healthy - restarted, 2),
        "/health 200 to UP in HAProxy (s)": round(up - healthy, 2),
        "load duration (s)": round(ended - t0, 1),
        "sent again by HAProxy to the other replica": len(redispatched),
    }
    print("\nreplicas behind HAProxy:", json.dumps(figures, indent=1))
    assert not failed, "\n".join(f"{o.started - t0:.2f}-{o.ended - t0:.2f} s client {o.client} status {o.status} "
                                  f"replica {o.replica}: {o.error}" for o in failed[:10]) + "\n" + log[-4000:]
    assert drained, "no request was in flight on r1 when it got SIGTERM"
    assert meanwhile and all(o.replica == "r2" for o in meanwhile), sorted({o.replica for o in meanwhile})
    assert draining is not None, "r1's /health did not answer 503 after its SIGTERM"
    assert up >= healthy - 0.1  # HAProxy took r1 back only once its /health answered 200
    assert rejoined, "the restarted replica got no request"
