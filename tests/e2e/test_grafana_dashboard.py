"""deploy/grafana-dashboard.json queries only what a live server exports.

The PromQL of every panel and variable is reduced to the metric names it reads; each must be a series
of a real ``/metrics`` scrape of a server on the real engine (a counter family ``x`` exports ``x_total``,
a histogram ``x`` exports ``x_bucket``, ``x_sum`` and ``x_count``), or, for the fleet row's ``smg_`` names, of
the real gateway (SMG) routing to such a server.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fleet import smg_binary
from tests.support.http import free_ports, until
from tests.support.paths import REPO

DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
# PromQL words that are not metric names: aggregation and set operators, modifiers.
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                      "bool", "offset", "inf", "nan"})
SERIES_OF_TYPE = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                  "gauge": ("",), "summary": ("", "_sum", "_count", "_created"), "info": ("_info",),
                  "untyped": ("",)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana ``label_values(...)`` query) reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals: label values, regexes
    text = re.sub(r"\{[^}]*\}", " ", text)                    # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)                   # range selectors [5m], [$__rate_interval]
    text = re.sub(r"\$\{?\w+\}?", " ", text)                  # Grafana variables
    text = re.sub(r"\boffset\s+-?\w+", " ", text)             # offset 5m
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"\blabel_values\s*\(([^,()]*),[^)]*\)", r"(\1)", text)  # label_values(metric, label)
    names = set()
    for match in re.finditer(r"(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)|[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = match.group(0), text[match.end():]
        if match.group(1) or rest.lstrip().startswith("(") or word.lower() in KEYWORDS:
            continue  # a number, a function call or an operator
        names.add(word)
    return names


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (nested rows too) and query variables."""
    found = []

    def walk(panels: list) -> None:
        for panel in panels:
            found.extend(t["expr"] for t in panel.get("targets", ()) if t.get("expr"))
            walk(panel.get("panels", ()))

    walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", ()):
        if variable.get("type") == "query":
            query = variable["query"]
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


def exported_series(metrics_text: str) -> set[str]:
    """Every series name the scrape exports or will export: by family type, so a counter with no sample
    yet (``http_timeouts`` before the first timeout) still counts."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(family.name + suffix for suffix in SERIES_OF_TYPE[family.type])
        names.update(sample.name for sample in family.samples)
    return names


@pytest.mark.parametrize("expr, names", [
    ('sum(rate(request_received_total{model_name=~"$model_name"}[$__rate_interval]))', {"request_received_total"}),
    ('histogram_quantile(0.95, sum by (le) (rate(time_to_first_token_seconds_bucket{a="b"}[5m])))',
     {"time_to_first_token_seconds_bucket"}),
    ("sum(rate(a_sum[1m])) / clamp_min(sum(rate(a_count[1m])), 1e-9)", {"a_sum", "a_count"}),
    ('sum by (kind, instance) (rate(http_timeouts_total{x=~"y|z"}[$__rate_interval])) * 2', {"http_timeouts_total"}),
    ("up offset 5m and on (job) other_metric", {"up", "other_metric"}),
    ('label_values(request_received_total{model_name=~"$model_name"}, instance)', {"request_received_total"}),
    ("num_requests_running", {"num_requests_running"}),
])
def test_metric_names_are_read_out_of_promql(expr, names):
    assert metric_names(expr) == names


def test_the_dashboard_is_grafana_json_with_the_panels_the_issue_asks_for():
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set().union(*map(metric_names, dashboard_queries(dashboard)))
    wanted = {"request_received_total",                                  # request rate
              "request_errors_total", "http_timeouts_total", "http_refused_total",  # errors by type
              "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",  # TTFT / ITL
              "num_requests_waiting", "http_requests_waiting_for_slot",  # queue depth
              "num_requests_running",                                    # batch size
              "cpu_cache_usage_perc",                                    # cache blocks in use
              "http_slots_in_use", "http_requests_reading_body", "http_open_connections",
              "prefix_cache_hit_rate"}
    assert wanted <= queried, sorted(wanted - queried)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["schemaVersion"] >= 30


def test_every_metric_the_dashboard_queries_is_exported_by_a_live_server(live_servers, default_engine):
    url = live_servers.start(default_engine)
    reply = requests.post(url + "/", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, timeout=120)
    assert reply.status_code == 200, reply.text
    scrape = requests.get(url + "/metrics", timeout=30)
    assert scrape.status_code == 200
    exported = exported_series(scrape.text)
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) > 20
    missing = {name: expr for expr in queries for name in metric_names(expr)
               if name not in exported and not name.startswith(GATEWAY)}
    assert not missing, f"the dashboard queries series the server does not export: {missing}"


GATEWAY = "smg_"  # the gateway's own series (the fleet row)


@pytest.mark.skipif(smg_binary() is None, reason="smg is not installed (pip install 'mindserve[gateway]')")
def test_every_gateway_metric_the_dashboard_queries_is_exported_by_smg_in_front_of_a_live_server(
        live_servers, default_engine):
    url = live_servers.start(default_engine)
    port, prometheus = free_ports(2)
    gateway = subprocess.Popen([smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
                                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus),
                                "--policy", "round_robin", "--worker-urls", url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def routable() -> bool:
            try:
                workers = requests.get(f"http://127.0.0.1:{port}/workers", timeout=5).json()["workers"]
            except (requests.RequestException, ValueError, KeyError):
                return False
            return any(w.get("is_healthy") for w in workers)

        assert until(routable, 60, poll=0.2)
        scrape = requests.get(f"http://127.0.0.1:{prometheus}/metrics", timeout=30)
    finally:
        gateway.terminate()
        gateway.wait(30)
    assert scrape.status_code == 200
    exported = exported_series(scrape.text)
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    wanted = {name for expr in queries for name in metric_names(expr) if name.startswith(GATEWAY)}
    assert {"smg_worker_requests_total", "smg_worker_cb_state", "smg_worker_health"} <= wanted
    assert wanted <= exported, sorted(wanted - exported)
