"""deploy/haproxy/haproxy-affinity.cfg, run by the real HAProxy in front of two stand-in replicas (small HTTP
servers that answer every POST at once, /health as told): requests that share a prompt prefix land on the same
replica, whatever follows the prefix, the route or the order of the JSON keys; the blind recipe
(haproxy.cfg) splits them; a replica that leaves and comes back gets its own prefixes back; one hot prefix
spills over to the other replica instead of queueing on one; a 503 of a draining replica is sent again to the
other. What the affinity is worth on real replicas is measured by bench/fleet_bench.py (docs/scale-out.md).
"""
from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tests.support.haproxy import HAPROXY, MISSING, HAProxy
from tests.support.http import free_ports, until

pytestmark = [pytest.mark.skipif(HAPROXY is None, reason=MISSING), pytest.mark.slow]

PREFIXES = [f"Tenant {t:02d} system prompt: you answer questions about document {t * 7919 % 1000:03d}. " * 4
            for t in range(24)]
TIMEOUT = 30


class Replica:
    """A stand-in for a mindserve replica: /health answers ``health``; a POST answers ``status`` (after
    ``gate`` opens) with the body it got."""

    def __init__(self) -> None:
        self.health, self.status = 200, 200
        self.gate = threading.Event()
        self.gate.set()
        self.in_flight = 0
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self.reply(replica.health, b"{}")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                replica.in_flight += 1
                try:
                    replica.gate.wait(TIMEOUT)
                finally:
                    replica.in_flight -= 1
                self.reply(replica.status, body)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # HAProxy hanging up on a held reply (a test's end) is not this test's concern

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def replicas():
    pair = {"r1": Replica(), "r2": Replica()}
    yield pair
    for replica in pair.values():
        replica.close()


def start(tmp_path, replicas, config: str, **env: str) -> HAProxy:
    (listen,) = free_ports(1)
    haproxy = HAProxy(tmp_path, listen, {name: ("127.0.0.1", r.port, r.port) for name, r in replicas.items()},
                      config=config, **env)
    assert until(lambda: all(haproxy.is_up(name) for name in replicas), 15, poll=0.05), haproxy.states()
    return haproxy


def tgi_body(prompt: str, rng: random.Random) -> dict:
    params = {"max_new_tokens": rng.randint(1, 64), "do_sample": rng.random() < 0.5}
    # either key first: the key is read from the JSON, not from the body's first bytes
    return {"inputs": prompt, "parameters": params} if rng.random() < 0.5 else {"parameters": params,
                                                                                  "inputs": prompt}


def send(url: str, prefix: str, n: int, rng: random.Random) -> str:
    """One request whose prompt is ``prefix`` and a question; the replica that answered."""
    question = f"Question {n}: what does line {rng.randint(1, 999)} say?"
    route = rng.choice(["/", "/generate", "/generate_stream", "/v1/completions"])
    body = ({"model": "m", "prompt": prefix + question, "max_tokens": 8} if route == "/v1/completions"
            else tgi_body(prefix + question, rng))
    reply = requests.post(url + route, data=json.dumps(body), headers={"Content-Type": "application/json"},
                          timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    return reply.headers["X-Mindserve-Replica"]


def placement(url: str, rounds: int = 3, seed: int = 0) -> dict[str, set[str]]:
    """Prefix → the replicas that answered its requests (``rounds`` each, interleaved across prefixes)."""
    rng = random.Random(seed)
    seen: dict[str, set[str]] = {p: set() for p in PREFIXES}
    for n in range(rounds):
        for prefix in rng.sample(PREFIXES, len(PREFIXES)):
            seen[prefix].add(send(url, prefix, n, rng))
    return seen


def test_requests_sharing_a_prefix_land_on_one_replica_and_the_blind_recipe_splits_them(tmp_path, replicas):
    affinity = start(tmp_path, replicas, "haproxy-affinity.cfg")
    try:
        seen = placement(affinity.url)
    finally:
        affinity.stop()
    split = {p[:10]: sorted(r) for p, r in seen.items() if len(r) > 1}
    assert not split, split
    homes = [next(iter(r)) for r in seen.values()]
    assert {"r1", "r2"} == set(homes), homes  # the prefixes are spread, not all on one replica
    assert min(homes.count("r1"), homes.count("r2")) >= len(PREFIXES) // 5, homes

    blind = start(tmp_path, replicas, "haproxy.cfg")
    try:
        seen = placement(blind.url)
    finally:
        blind.stop()
    assert sum(len(r) > 1 for r in seen.values()) >= len(PREFIXES) // 2, seen


def test_a_replica_that_leaves_and_returns_gets_its_own_prefixes_back(tmp_path, replicas):
    haproxy = start(tmp_path, replicas, "haproxy-affinity.cfg")
    try:
        before = {p: next(iter(r)) for p, r in placement(haproxy.url, rounds=1).items()}
        replicas["r2"].health = 503
        assert until(lambda: not haproxy.is_up("r2"), 10, poll=0.05), haproxy.states()
        during = {p: next(iter(r)) for p, r in placement(haproxy.url, rounds=1, seed=1).items()}
        replicas["r2"].health = 200
        assert until(lambda: haproxy.is_up("r2"), 10, poll=0.05), haproxy.states()
        after = {p: next(iter(r)) for p, r in placement(haproxy.url, rounds=1, seed=2).items()}
    finally:
        haproxy.stop()
    assert set(during.values()) == {"r1"}
    assert after == before


@pytest.mark.parametrize("balance, spills", [("150", True), (None, False)])
def test_one_hot_prefix_spills_over_past_the_load_bound(tmp_path, replicas, balance, spills):
    """At MINDSERVE_AFFINITY_BALANCE=150 the home replica takes at most 1.5x the average of open requests and
    the rest spill; at the default (200) two replicas never move a request."""
    env = {"MINDSERVE_AFFINITY_BALANCE": balance} if balance else {}
    haproxy = start(tmp_path, replicas, "haproxy-affinity.cfg", **env)
    hot = PREFIXES[0]
    try:
        (home,) = placement(haproxy.url, rounds=1)[hot]
        for replica in replicas.values():
            replica.gate.clear()
        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(send, haproxy.url, hot, n, random.Random(n)) for n in range(8)]
            assert until(lambda: sum(r.in_flight for r in replicas.values()) == 8, 10), \
                {name: r.in_flight for name, r in replicas.items()}
            held = {name: r.in_flight for name, r in replicas.items()}
            for replica in replicas.values():
                replica.gate.set()
            answered = [a.result(TIMEOUT) for a in answers]
        (again,) = placement(haproxy.url, rounds=1, seed=3)[hot]
    finally:
        haproxy.stop()
    other = "r2" if home == "r1" else "r1"
    if spills:
        assert held[home] > held[other] > 0, held
        assert sorted(set(answered)) == ["r1", "r2"]
    else:
        assert held == {home: 8, other: 0}, held
    assert again == home  # once the load is gone, the prefix is home again


def test_a_draining_replicas_503_is_sent_again_to_the_other(tmp_path, replicas):
    haproxy = start(tmp_path, replicas, "haproxy-affinity.cfg")
    try:
        homes = {p: next(iter(r)) for p, r in placement(haproxy.url, rounds=1).items()}
        replicas["r1"].status = 503  # refuses every request, its /health still 200: between SIGTERM and a check
        moved = placement(haproxy.url, rounds=1, seed=4)
    finally:
        haproxy.stop()
    assert "r1" in homes.values()
    assert all(r == {"r2"} for r in moved.values()), moved
