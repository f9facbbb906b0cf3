"""The fleet launcher (deploy/fleet/fleet.py) for tests: replicas and SMG on free loopback ports, optionally with
every decode step slowed (tests/support/served.py's bootstrap) so requests stay in flight long enough to observe."""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from tests.support.http import free_ports
from tests.support.paths import REPO
from tests.support.served import BOOTSTRAP

FLEET_PY = REPO / "deploy" / "fleet" / "fleet.py"


def fleet_module() -> ModuleType:
    """deploy/fleet/fleet.py, imported by path (deploy/ is not a package)."""
    name = "mindserve_deploy_fleet"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FLEET_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def smg_binary() -> str | None:
    """The smg binary the launcher would use (None: not installed)."""
    return fleet_module().find_smg()


def local_fleet(log_dir: Path, replicas: int = 2, *, serve_args: Sequence[str] = (), gateway: bool = True,
                policy: str = "cache_aware", gateway_args: Sequence[str] = (), slow_decode: float = 0.0,
                replica_args: Sequence[Sequence[str]] = (), worker_urls: Sequence[str] = (),
                cpus: Sequence[int] | None = None, ready_timeout: float = 300.0, grace: float = 40.0):
    """A not yet started ``Fleet`` on free 127.0.0.1 ports (``with local_fleet(...) as fleet:`` starts it).
    ``slow_decode`` > 0: every replica sleeps that long before each decode step. ``replicas=0`` with
    ``worker_urls``: a gateway alone, in front of replicas already running."""
    ports = free_ports(replicas + 2)
    replica_cmd = [sys.executable, "-c", BOOTSTRAP, str(slow_decode)] if slow_decode else None
    return fleet_module().Fleet(replicas, ports=ports[:replicas], gateway=gateway, gateway_port=ports[-2],
                                prometheus_port=ports[-1], policy=policy, gateway_args=gateway_args,
                                serve_args=serve_args, replica_args=replica_args, replica_cmd=replica_cmd,
                                worker_urls=worker_urls,
                                cpus=cpus, log_dir=log_dir,
                                ready_timeout=ready_timeout, grace=grace)
