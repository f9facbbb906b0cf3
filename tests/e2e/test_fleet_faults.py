"""Faults under load, through the real SMG (deploy/fleet/fleet.py's gateway, the resilience settings of
tests/support/gateway_faults.py), with nothing lost: a replica SIGKILLed, a rolling restart, a stalled replica
(SIGSTOP) ejected and readmitted, a replica announced in SMG's discovery file taking traffic. Each test runs on two
topologies: every process on loopback, and each replica in its own network namespace with the gateway in
another (tests/support/netns.py), so requests cross a network stack as between machines.

Two replicas of the default model (small context, few tokens, every decode step slowed by 30 ms so requests are
in flight when the fault comes), 6 clients sending streamed and plain /v1/completions back to back. Every wait
is bounded; the figures are printed (pytest -s) and reported in docs/scale-out.md.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from tests.support import netns
from tests.support.fleet import fleet_module, smg_binary
from tests.support.gateway_faults import (EJECTION_WINDOW, RESILIENCE, Load, Smg, first_time, one_request,
                                          running)
from tests.support.http import free_ports
from tests.support.paths import REPO
from tests.support.served import BOOTSTRAP

pytestmark = [pytest.mark.slow, pytest.mark.skipif(smg_binary() is None, reason="smg is not installed "
                                                   "(pip install 'mindserve[gateway]')")]

SERVE_ARGS = ("--ctx-size", "256", "--max-batch-size", "8")
SLOW_DECODE = 0.03
GRACE = 40         # s: a replica's drain and exit
START = 300        # s: a replica's start-up on a busy machine
WARM = 3.0         # s of load before a fault, and after a recovery


@dataclass
class Topology:
    """Two replicas (each its own single-replica Fleet, so each can be signalled and restarted alone) and SMG."""

    name: str
    replica_fleets: list
    gateway: object
    smg: Smg
    model: str
    make_gateway: object  # (gateway_args, worker_urls, log_dir) -> a not yet started gateway Fleet
    extra: list = field(default_factory=list)

    @property
    def replicas(self) -> list:
        return [f.replicas[0] for f in self.replica_fleets]

    def restart(self, member) -> None:
        """Start a replica again on its address and port; return once its /health is 200 and SMG routes to it."""
        member.start(REPO)
        ok = first_time(lambda: status(member.url + "/health") == 200, START, poll=0.2)
        assert ok is not None, member.log_tail()
        assert first_time(lambda: self.smg.routable(member.url), 30) is not None, self.smg.workers()


def status(url: str) -> int | None:
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return None


def replica_fleet(fm, log_dir: Path, host: str, port: int, cpu: int, prefix: list[str], model: Path):
    cmd = [*prefix, sys.executable, "-c", BOOTSTRAP, str(SLOW_DECODE)]
    return fm.Fleet(1, host=host, ports=[port], gateway=False, serve_args=(str(model), *SERVE_ARGS),
                    replica_cmd=cmd,
                    cpus=[cpu], log_dir=log_dir, ready_timeout=START, grace=GRACE)


def gateway_fleet(fm, log_dir: Path, host: str, worker_urls: list[str], gateway_args, smg: str):
    port, prometheus = free_ports(2)
    return fm.Fleet(0, host=host, gateway=True, gateway_port=port, prometheus_port=prometheus,
                    policy="round_robin", gateway_args=gateway_args, worker_urls=worker_urls, log_dir=log_dir,
                    smg=smg, ready_timeout=60)


def smg_of(fleet, host: str) -> Smg:
    prometheus = fleet.gateway.cmd[fleet.gateway.cmd.index("--prometheus-port") + 1]
    return Smg(fleet.gateway_url, f"http://{host}:{prometheus}")


@pytest.fixture(scope="module", params=["loopback", "netns"])
def topology(request, tmp_path_factory, default_q4_dir):
    if request.param == "netns" and (reason := netns.unavailable()):
        pytest.skip(f"no network namespaces: {reason}")
    fm = fleet_module()
    log_dir = tmp_path_factory.mktemp(f"fleet-{request.param}")
    hosts = netns.Hosts(["gw", "r0", "r1"]) if request.param == "netns" else None
    started: list = []
    try:
        cpus = sorted(os.sched_getaffinity(0))
        ports = free_ports(2)
        replica_fleets = []
        for i in range(2):
            host = hosts.addresses[f"r{i}"] if hosts else "127.0.0.1"
            prefix = hosts.exec_prefix(f"r{i}") if hosts else []
            fleet = replica_fleet(fm, log_dir / f"r{i}", host, ports[i], cpus[i % len(cpus)], prefix,
                                  default_q4_dir)
            replica_fleets.append(fleet)
        for fleet in replica_fleets:  # start both, then wait for both
            fleet.replicas[0].start(REPO)
            started.append(fleet)
        for fleet in replica_fleets:
            member = fleet.replicas[0]
            ready = first_time(lambda: status(member.url + "/health") == 200 or not member.alive(), START, poll=0.2)
            assert ready is not None and member.alive(), member.log_tail()
        gw_host = hosts.addresses["gw"] if hosts else "127.0.0.1"
        smg = smg_binary()
        if hosts:  # SMG in the gateway's namespace: a wrapper that enters it
            wrapper = log_dir / "smg-in-netns"
            wrapper.write_text("#!/bin/sh\nexec " + " ".join(hosts.exec_prefix("gw")) + f' {smg} "$@"\n')
            wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
            smg = str(wrapper)

        def make_gateway(gateway_args, worker_urls, where):
            return gateway_fleet(fm, where, gw_host, worker_urls, gateway_args, smg)

        urls = [f.replicas[0].url for f in replica_fleets]
        gateway = make_gateway(RESILIENCE, urls, log_dir / "gateway")
        gateway.start()
        started.append(gateway)
        model = requests.get(urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
        yield Topology(request.param, replica_fleets, gateway, smg_of(gateway, gw_host), model, make_gateway)
    finally:
        for fleet in reversed(started):
            fleet.stop()
        if hosts:
            hosts.down()


def figures(topology: Topology, title: str, values: dict) -> None:
    print(f"\n{title} ({topology.name}):", json.dumps(values, indent=1))


def test_a_killed_replica_loses_no_request_it_had_not_started(topology):
    victim = topology.replicas[0]
    load = Load(topology.gateway.gateway_url, topology.model)
    try:
        time.sleep(WARM)
        assert first_time(lambda: running(victim.url) > 0, 30) is not None, "nothing ran on the victim"
        killed = time.monotonic()
        victim.signal(signal.SIGKILL)
        ejected = first_time(lambda: not topology.smg.routable(victim.url), 30)
        time.sleep(WARM)
    finally:
        ended_in_time = load.stop()
    victim.wait(10)
    topology.restart(victim)

    after = [o for o in load.outcomes if o.started > killed]
    in_flight = [o for o in load.outcomes if o.started <= killed < o.ended]
    cut = [o for o in in_flight if not o.ok]
    figures(topology, "SIGKILL", {
        "requests": len(load.outcomes), "sent after the kill": len(after),
        "failed among those": sum(not o.ok for o in after), "in flight at the kill": len(in_flight),
        "of which ended with an error": len(cut), "streams ended by an error event": sum(o.error_event for o in cut),
        "kill -> SMG stops routing to it (s)": None if ejected is None else round(ejected - killed, 2),
        "SMG retries": topology.smg.retries()})
    assert ended_in_time, "a request hung"
    assert after and not [o for o in after if not o.ok], load.describe([o for o in after if not o.ok])
    # A stream the dead replica was serving ends with SMG's error event, never a silent cut; a plain request it
    # was serving ends with an error status.
    assert all(o.error_event for o in cut if o.stream), load.describe(cut)
    assert all(o.status is not None and o.status >= 500 for o in cut if not o.stream), load.describe(cut)
    assert ejected is not None


def test_a_rolling_restart_loses_no_request(topology):
    load = Load(topology.gateway.gateway_url, topology.model)
    served_after: dict[str, float] = {}
    try:
        time.sleep(WARM)
        for member in topology.replicas:
            member.signal(signal.SIGTERM)
            assert member.wait(GRACE + 15) == 0, member.log_tail()
            topology.restart(member)
            returned = topology.smg.sent_to(member.url)
            time.sleep(WARM)
            served_after[member.url] = topology.smg.sent_to(member.url) - returned
    finally:
        ended_in_time = load.stop()
    failed = load.failed()
    figures(topology, "rolling restart", {"requests": len(load.outcomes), "failed": len(failed),
                                          "sent to each replica after its return": served_after,
                                          "SMG retries": topology.smg.retries()})
    assert ended_in_time, "a request hung"
    assert not failed, load.describe(failed)
    assert all(n > 0 for n in served_after.values()), served_after


def test_a_stalled_replica_is_ejected_and_readmitted(topology):
    victim = topology.replicas[1]
    load = Load(topology.gateway.gateway_url, topology.model)
    try:
        time.sleep(WARM)
        stopped = time.monotonic()
        victim.signal(signal.SIGSTOP)
        ejected = first_time(lambda: not topology.smg.routable(victim.url), EJECTION_WINDOW * 3)
        assert ejected is not None, topology.smg.workers()
        sent_at_ejection = topology.smg.sent_to(victim.url)
        # The load's clients may all be waiting on the stalled replica by now (each sent it every other request
        # until it was out): fresh requests show what a client sees while it is out.
        with requests.Session() as session:
            while_out = [one_request(session, topology.gateway.gateway_url, topology.model, 99, n, 12)
                         for n in range(3)]
        time.sleep(WARM)
        sent_while_out = topology.smg.sent_to(victim.url) - sent_at_ejection
        resumed = time.monotonic()
        victim.signal(signal.SIGCONT)
        readmitted = first_time(lambda: topology.smg.routable(victim.url), 30)
        assert readmitted is not None, topology.smg.workers()
        sent_at_readmission = topology.smg.sent_to(victim.url)
        time.sleep(WARM)
        sent_after = topology.smg.sent_to(victim.url) - sent_at_readmission
    finally:
        victim.signal(signal.SIGCONT)
        ended_in_time = load.stop()
    failed = load.failed()
    figures(topology, "SIGSTOP", {
        "requests": len(load.outcomes), "failed": len(failed),
        "SIGSTOP -> ejected (s)": round(ejected - stopped, 2), "configured window (s)": EJECTION_WINDOW,
        "sent to it while out": sent_while_out, "fresh requests answered while out": sum(o.ok for o in while_out),
        "SIGCONT -> readmitted (s)": round(readmitted - resumed, 2), "sent to it after readmission": sent_after})
    assert ended_in_time, "a request hung"
    assert not failed, load.describe(failed)  # those it held finished after SIGCONT; the rest went elsewhere
    assert sent_while_out == 0 and all(o.ok and o.ended < resumed for o in while_out), while_out
    assert sent_after > 0


def test_a_replica_announced_in_the_discovery_file_takes_traffic(topology, tmp_path):
    first, second = topology.replicas
    manifest = tmp_path / "workers.json"

    def announce(*members) -> None:
        staged = manifest.with_suffix(".new")
        staged.write_text(json.dumps({"version": 1, "workers": [{"url": m.url} for m in members]}))
        staged.replace(manifest)  # one rename: SMG never reads half a file

    announce(first)
    gateway = topology.make_gateway((*RESILIENCE, "--discovery-provider", "file", "--discovery-file", str(manifest)),
                                    [], tmp_path / "gateway")
    gateway.start()
    host = gateway.gateway_url.split("//", 1)[1].rsplit(":", 1)[0]
    smg = smg_of(gateway, host)
    try:
        assert first_time(lambda: smg.routable(first.url), 30) is not None, smg.workers()
        load = Load(gateway.gateway_url, topology.model)
        try:
            time.sleep(WARM)
            before = smg.sent_to(second.url)
            announced = time.monotonic()
            announce(first, second)
            takes = first_time(lambda: smg.sent_to(second.url) > before, 30)
            time.sleep(WARM)
        finally:
            ended_in_time = load.stop()
    finally:
        gateway.stop()
    failed = load.failed()
    figures(topology, "file discovery", {"requests": len(load.outcomes), "failed": len(failed),
                                         "announced -> first request sent to it (s)":
                                             None if takes is None else round(takes - announced, 2)})
    assert ended_in_time, "a request hung"
    assert takes is not None, smg.workers()
    assert not failed, load.describe(failed)
