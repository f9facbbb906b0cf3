"""Reading a server's /metrics in tests: the samples labelled with the model, and how much one moved."""
from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    """Sample name → value for the samples labelled with the model (a histogram bucket keeps its ``le``, an HTTP
    timeout or refusal counter its ``kind`` or ``reason``, the failures by type their ``error_type``, the
    per-adapter counters their ``adapter`` (and ``outcome``), the requests by priority their ``priority``, the engine
    steps their ``kind``)."""
    reply = requests.get(url + "/metrics", timeout=10)
    assert reply.status_code == 200
    assert reply.headers["Content-Type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            if sample.name.endswith("_info"):
                continue  # a configuration record (vLLM's cache_config_info): its labels are settings, not a measure
            extra = set(sample.labels) - {"model_name"}
            assert "model_name" in sample.labels, sample
            assert len(extra) <= 1 or extra in ({"adapter", "outcome"}, {"kind", "le"}), sample
            assert extra <= {"le", "kind", "reason", "error_type", "adapter", "outcome", "priority"}, sample
            key = sample.name + "".join(f"{{{name}={sample.labels[name]}}}" for name in sorted(extra))
            out[key] = sample.value
    return out


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)
