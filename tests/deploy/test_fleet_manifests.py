"""deploy/kubernetes/fleet/*.yaml: replicas for a gateway, SMG with Kubernetes service discovery, the Gateway API
Inference Extension variant, Prometheus' scrape configuration.

Offline, like tests/deploy/test_manifests.py: the core objects against the API's own schemas (strict), the
InferencePool against its CRD's schema (tests/deploy/crds/), and the rules that tie them together: the gateway
selects exactly the replica pods, reads them on the port that serves /health and /metrics (the replicas' own
config, loaded by the server's config reader), probes what the server answers, drains within the pod's grace
period, and Prometheus scrapes both tiers on their metrics ports.
"""
from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from service.config import load_server_config
from tests.support.gateway_faults import RESILIENCE
from tests.support.paths import REPO

FLEET = REPO / "deploy" / "kubernetes" / "fleet"
MANIFESTS = sorted(FLEET.glob("*.yaml"))
CRDS = Path(__file__).parent / "crds"
VERSIONS = ("1.29", kubernetes_validate.latest_version())
CUSTOM = {"InferencePool", "HTTPRoute"}


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def the(kind: str, component: str | None = None) -> dict:
    found = [doc for doc in documents() if doc["kind"] == kind
             and (component is None or doc["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, (kind, component, len(found))
    return found[0]


def container(component: str) -> dict:
    (found,) = the("Deployment", component)["spec"]["template"]["spec"]["containers"]
    return found


def flag(args: list[str], name: str) -> str:
    """The value of ``--name=value`` or ``--name value`` in a container's args."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}":
            return args[i + 1]
    raise KeyError(name)


@pytest.fixture(scope="module")
def replica_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("fleet") / "server.yaml"
    path.write_text(the("ConfigMap", "fleet-replica")["data"]["server.yaml"])
    return load_server_config(path)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_core_object_is_a_valid_kubernetes_object(path: Path, version: str):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] not in CUSTOM]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def inference_pool_schema() -> dict:
    crd = yaml.safe_load((CRDS / "inferencepools.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def test_the_inference_pool_passes_its_crds_schema_and_a_broken_one_does_not():
    schema, pool = inference_pool_schema(), the("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, schema)
    broken = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 70000}]}}
    with pytest.raises(jsonschema.ValidationError, match="70000"):
        jsonschema.validate(broken, schema)


def test_the_kinds_are_there():
    kinds = sorted(doc["kind"] for doc in documents())
    assert kinds == sorted(["ConfigMap", "Deployment", "PodDisruptionBudget", "ServiceAccount", "Role",
                            "RoleBinding", "Deployment", "PodDisruptionBudget", "Service", "InferencePool",
                            "HTTPRoute", "ConfigMap"])


def test_the_gateway_discovers_exactly_the_replica_pods_on_the_port_that_serves_what_it_reads(replica_config):
    args = container("gateway")["args"]
    assert args[0] == "launch" and "--service-discovery" in args
    key, _, value = flag(args, "selector").partition("=")
    pods = the("Deployment", "fleet-replica")["spec"]["template"]["metadata"]["labels"]
    gateway_pods = the("Deployment", "gateway")["spec"]["template"]["metadata"]["labels"]
    assert pods.get(key) == value and gateway_pods.get(key) != value
    port = int(flag(args, "service-discovery-port"))
    server = replica_config.server
    # /health, /metrics and /v1/models on the port SMG reads: no management or metrics split
    assert port == server.port and server.management_port in (None, port) and server.metrics_port in (None, port)
    (http,) = container("fleet-replica")["ports"]
    assert http["containerPort"] == port
    assert flag(args, "service-discovery-namespace") == "$(POD_NAMESPACE)"
    role = the("Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert the("Deployment", "gateway")["spec"]["template"]["spec"]["serviceAccountName"] == \
        the("RoleBinding")["subjects"][0]["name"] == the("ServiceAccount")["metadata"]["name"]


def test_the_gateway_runs_with_the_resilience_the_fault_tests_proved():
    args = container("gateway")["args"]
    tested = dict(zip(RESILIENCE[::2], RESILIENCE[1::2]))
    assert {name: flag(args, name[2:]) for name in tested} == tested
    assert flag(args, "policy") == "cache_aware"


def test_probes_and_drain_match_the_server(replica_config):
    c = container("fleet-replica")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pre_stop >= c["readinessProbe"]["periodSeconds"]
    spec = the("Deployment", "fleet-replica")["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + replica_config.server.shutdown_grace_period + 5
    assert c["args"] == ["--config", "/etc/mindserve-fleet/server.yaml"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
    assert mount["mountPath"] == "/etc/mindserve-fleet"
    gw = container("gateway")
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/liveness"


def test_the_replica_config_differs_from_the_single_service_one_only_in_its_ports(replica_config):
    single = load_server_config(REPO / "deploy" / "server.yaml")
    assert replica_config.engine == single.engine
    assert single.server.management_port != single.server.port  # the Service setup splits them; the fleet cannot


def test_the_inference_pool_selects_the_replicas_on_their_port():
    pool, route = the("InferencePool")["spec"], the("HTTPRoute")["spec"]
    pods = the("Deployment", "fleet-replica")["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= pods.items()
    assert [p["number"] for p in pool["targetPorts"]] == [container("fleet-replica")["ports"][0]["containerPort"]]
    (rule,) = route["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", the("InferencePool")["metadata"]["name"])
    assert backend["port"] == pool["targetPorts"][0]["number"]


def test_prometheus_scrapes_both_tiers_on_their_metrics_ports():
    config = yaml.safe_load(the("ConfigMap", "monitoring")["data"]["prometheus.yml"])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    expected = {"mindserve-replicas": ("fleet-replica", container("fleet-replica")["ports"][0]["containerPort"]),
                "mindserve-gateway": ("gateway", int(flag(container("gateway")["args"], "prometheus-port")))}
    assert set(jobs) == set(expected)
    for name, (component, port) in expected.items():
        keep = {tuple(r["source_labels"]): r["regex"] for r in jobs[name]["relabel_configs"]
                if r.get("action") == "keep"}
        assert keep[("__meta_kubernetes_pod_label_app_kubernetes_io_component",)] == component
        assert keep[("__meta_kubernetes_pod_container_port_number",)] == str(port)
        assert re.fullmatch(r"/metrics", jobs[name]["metrics_path"])
