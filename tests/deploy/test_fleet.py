"""deploy/fleet/fleet.py without starting anything: how the cores are shared out, the commands it would run."""
from __future__ import annotations

import pytest

from tests.support.fleet import fleet_module

fleet = fleet_module()


@pytest.mark.parametrize(("cpus", "n", "expected"), [
    ([0, 1], 2, [(0,), (1,)]),
    ([0, 1, 2, 3], 2, [(0, 1), (2, 3)]),
    ([0, 1, 2, 3, 4], 2, [(0, 1, 2), (3, 4)]),
    ([3, 1, 2, 0], 3, [(0, 1), (2,), (3,)]),
    ([0, 1], 3, [(0,), (1,), (0,)]),
    ([0, 1], 1, [(0, 1)]),
    ([0, 1], 0, []),
])
def test_split_cores(cpus, n, expected):
    assert fleet.split_cores(cpus, n) == expected


def test_parse_cpus():
    assert fleet.parse_cpus("0-3,6") == [0, 1, 2, 3, 6]
    assert fleet.parse_cpus("2") == [2]


def test_commands(tmp_path):
    f = fleet.Fleet(2, ports=[9001, 9002], cpus=[0, 1, 2, 3], gateway_port=9000, prometheus_port=9100,
                    policy="least_load", serve_args=["--ctx-size", "512"], smg="/x/smg",
                    worker_urls=["http://10.0.0.9:1025"], log_dir=tmp_path, gateway_args=["--log-level", "warn"],
                    replica_args=[["--owned-by", "vllm"]])
    r0, r1 = f.replicas
    assert r0.cmd[-2:] == ["--owned-by", "vllm"] and r1.cmd[-2:] == ["--ctx-size", "512"]
    r0.cmd = r0.cmd[:-2]
    assert r0.cmd[:3] == ["taskset", "-c", "0,1"] and r1.cmd[:3] == ["taskset", "-c", "2,3"]
    assert r0.cmd[-8:] == ["--host", "127.0.0.1", "--port", "9001", "--threads", "2", "--ctx-size", "512"]
    assert f.replica_urls == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    g = f.gateway.cmd
    assert g[:2] == ["/x/smg", "launch"] and g[g.index("--policy") + 1] == "least_load"
    at = g.index("--worker-urls")
    assert g[at + 1:at + 4] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://10.0.0.9:1025"]
    assert g[-2:] == ["--log-level", "warn"]
    assert f.gateway_url == "http://127.0.0.1:9000"


def test_args_after_double_dash_go_to_serve():
    args = fleet.parse_args(["-n", "3", "--no-gateway", "--", "MODEL", "--ctx-size", "256"])
    assert args.replicas == 3 and args.no_gateway and args.serve_args == ["MODEL", "--ctx-size", "256"]


def test_replica_count_must_match_ports(tmp_path):
    with pytest.raises(ValueError):
        fleet.Fleet(2, ports=[9001], gateway=False, log_dir=tmp_path)
