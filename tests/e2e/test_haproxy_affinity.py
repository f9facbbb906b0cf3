"""deploy/haproxy/haproxy-affinity.cfg, run by the real HAProxy in front of two stand-in replicas (small HTTP
servers that answer every POST, at once or when a test opens their gate; /health as told): requests that share
a prompt prefix land on the same replica, whatever follows the prefix, the route or the order of the JSON keys;
the blind recipe (haproxy.cfg) splits them; a new prefix goes to the less loaded replica and a known one to its
home whatever the load; a replica's prefixes move to the other while it is out, and stay there (their cache is
there now); a 503 of a draining replica is sent again to the other, which keeps the prefix. What the affinity
is worth on real replicas is measured by bench/fleet_bench.py (docs/scale-out.md).
"""
from __future__ import annotations

import json
import random
import threading
import time
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
    assert min(homes.count("r1"), homes.count("r2")) >= len(PREFIXES) // 3, homes

    blind = start(tmp_path, replicas, "haproxy.cfg")
    try:
        seen = placement(blind.url)
    finally:
        blind.stop()
    assert sum(len(r) > 1 for r in seen.values()) >= len(PREFIXES) // 2, seen


def test_a_new_prefix_goes_to_the_less_loaded_replica_and_a_known_one_goes_home(tmp_path, replicas):
    haproxy = start(tmp_path, replicas, "haproxy-affinity.cfg")
    fresh = [f"Tenant {t} joins later: a document of its own, number {t * 31}. " * 6 for t in range(100, 106)]
    try:
        homes = {p: next(iter(r)) for p, r in placement(haproxy.url, rounds=1).items()}
        busy = next(iter(homes.values()))
        idle = "r2" if busy == "r1" else "r1"
        replicas[busy].gate.clear()  # the busy replica holds what it gets
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(send, haproxy.url, p, 9, random.Random(9))
                    for p in [p for p, home in homes.items() if home == busy][:3]]
            # three requests of its own prefixes go home although it has more open requests than the other
            assert until(lambda: replicas[busy].in_flight == 3, 10), replicas[busy].in_flight
            placed = [send(haproxy.url, p, 0, random.Random(0)) for p in fresh]
            replicas[busy].gate.set()
            assert [h.result(TIMEOUT) for h in held] == [busy] * 3
        again = [send(haproxy.url, p, 1, random.Random(1)) for p in fresh]
    finally:
        haproxy.stop()
    assert placed == [idle] * len(fresh)  # placed by load: the busy replica has 3 open requests, the other none
    assert again == placed  # and remembered there once the load is gone


def test_a_prefix_idle_past_the_expiry_is_placed_by_load_again(tmp_path, replicas):
    haproxy = start(tmp_path, replicas, "haproxy-affinity.cfg", MINDSERVE_AFFINITY_EXPIRE="1s")
    try:
        homes = {p: next(iter(r)) for p, r in placement(haproxy.url, rounds=1).items()}
        idle_prefix, home = next(iter(homes.items()))
        other = "r2" if home == "r1" else "r1"
        busy_prefix = next(p for p, h in homes.items() if h == home and p != idle_prefix)
        replicas[home].gate.clear()
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(send, haproxy.url, busy_prefix, 9, random.Random(9))
            assert until(lambda: replicas[home].in_flight == 1, 10), replicas[home].in_flight
            time.sleep(1.5)  # past the expiry: the idle prefix is forgotten
            moved = send(haproxy.url, idle_prefix, 1, random.Random(1))
            replicas[home].gate.set()
            assert held.result(TIMEOUT) == home
    finally:
        haproxy.stop()
    assert moved == other  # placed by load, away from its old home, which has an open request


def test_a_replica_that_leaves_hands_its_prefixes_to_the_other_for_good(tmp_path, replicas):
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
    assert "r2" in before.values()
    assert set(during.values()) == {"r1"}
    assert after == during  # the prefixes r2 had are in r1's cache now: they stay, r2 takes new ones


def test_a_draining_replicas_503_is_sent_again_to_the_other_which_keeps_the_prefix(tmp_path, replicas):
    haproxy = start(tmp_path, replicas, "haproxy-affinity.cfg")
    try:
        homes = {p: next(iter(r)) for p, r in placement(haproxy.url, rounds=1).items()}
        replicas["r1"].status = 503  # refuses every request, its /health still 200: between SIGTERM and a check
        moved = placement(haproxy.url, rounds=1, seed=4)
        replicas["r1"].status = 200
        later = placement(haproxy.url, rounds=1, seed=5)
    finally:
        haproxy.stop()
    assert "r1" in homes.values()
    assert all(r == {"r2"} for r in moved.values()), moved
    assert all(r == {"r2"} for r in later.values()), later
