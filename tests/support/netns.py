"""Several hosts on one machine: network namespaces joined by veth pairs to a bridge (in a namespace of its own),
each with its own address, and one veth from this namespace to the bridge so the test process reaches them all.
Created and removed by the tests (tests/e2e/test_fleet_faults.py); needs ``ip`` and CAP_NET_ADMIN (root)."""
from __future__ import annotations

import os
import shutil
import subprocess

IP = shutil.which("ip") or "/usr/sbin/ip"


def ip(*args: str) -> None:
    out = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can): no ``ip``, or ``ip netns add`` refused."""
    if not os.path.exists(IP):
        return "no ip command (iproute2)"
    probe = f"msprobe{os.getpid() % 100000}"
    out = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"ip netns add is refused here ({out.stderr.strip() or out.returncode}): needs CAP_NET_ADMIN"
    subprocess.run([IP, "netns", "del", probe], capture_output=True, timeout=30)
    return None


def claim_switch() -> int:
    """A free ``k`` (1..250), claimed by creating the switch namespace ``ms<k>sw``: ``ip netns add`` refuses a name
    that exists, so two processes at once (two test workers, two runs) never get the same k, hence never the same
    names or subnet. The search starts at a k of this pid's."""
    start = os.getpid() % 250
    for i in range(250):
        k = (start + i) % 250 + 1
        out = subprocess.run([IP, "netns", "add", f"ms{k}sw"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return k
        if "exists" not in out.stderr:
            raise RuntimeError(f"ip netns add ms{k}sw: {out.stderr.strip()}")
    raise RuntimeError("the namespaces ms1sw .. ms250sw all exist (left by killed runs? ip netns del them)")


class Hosts:
    """Namespaces ``names`` ("gw", "r0", ...), each at 10.213.<k>.<10+i>; this namespace at 10.213.<k>.1; ``k``
    claimed (``claim_switch``), so the names (``ms<k>...``) and the subnet are this object's alone."""

    def __init__(self, names: list[str]) -> None:
        k = claim_switch()
        self.prefix = f"ms{k}"
        self.switch = f"{self.prefix}sw"
        self.host_if = f"{self.prefix}h"
        self.here = f"10.213.{k}.1"
        self.namespaces = {name: f"{self.prefix}{name}" for name in names}
        self.addresses = {name: f"10.213.{k}.{10 + i}" for i, name in enumerate(names)}
        self._made: list[str] = [self.switch]
        try:
            self._up()
        except BaseException:
            self.down()
            raise

    def _up(self) -> None:
        ip("-n", self.switch, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        ip("link", "add", self.host_if, "type", "veth", "peer", "name", f"{self.host_if}s")
        ip("link", "set", f"{self.host_if}s", "netns", self.switch)
        ip("-n", self.switch, "link", "set", f"{self.host_if}s", "master", "br0", "up")
        ip("addr", "add", f"{self.here}/24", "dev", self.host_if)
        ip("link", "set", self.host_if, "up")
        for name, ns in self.namespaces.items():
            ip("netns", "add", ns)
            self._made.append(ns)
            inside, outside = f"{ns}i", f"{ns}s"
            ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            ip("link", "set", inside, "netns", ns)
            ip("link", "set", outside, "netns", self.switch)
            ip("-n", self.switch, "link", "set", outside, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", inside)
            ip("-n", ns, "link", "set", inside, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def exec_prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program in namespace ``name``."""
        return [IP, "netns", "exec", self.namespaces[name]]

    def down(self) -> None:
        """Remove every namespace made (their veths go with them) and this namespace's veth."""
        for ns in reversed(self._made):
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run([IP, "link", "del", self.host_if], capture_output=True, timeout=30)
        self._made.clear()
