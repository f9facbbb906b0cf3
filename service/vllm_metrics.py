"""The vLLM-named series a gateway reads on ``/metrics``, beside our own (same values, same ``model_name`` label).

SMG reads ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` of a
worker whose ``/v1/models`` says ``owned_by: "vllm"``; llm-d's endpoint picker reads the same gauges and
``vllm:cache_config_info``, ``vllm:lora_requests_info``; dashboards read the prefix-cache counters and the latency
histograms. Nothing here is measured twice: each series is one of ours under vLLM's name (deploy/fleet/README.md).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LABELS = ("model_name",)
# Our histogram -> vLLM's name for it (service/metrics.py observes ours).
HISTOGRAM_NAMES = {
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}


def engine_families(info: dict[str, Any], model_name: str) -> Iterable[Metric]:
    """One model's vLLM gauges and counters from its ``backend.info()``; a figure the engine lacks is left out."""
    usage = kv_usage(info)
    for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch (vLLM's name).", info.get("running")),
            ("vllm:num_requests_waiting", "Requests queued or still prefilling (vLLM's name).", info.get("waiting")),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (1: every block in use; vLLM's name).", usage)):
        if value is not None:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric([model_name], value)
            yield family
    for name, doc, key in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's name).",
             "prefix_cache_query_tokens"),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (vLLM's name).",
             "prefix_cache_hit_tokens")):
        if info.get(key) is not None:
            family = CounterMetricFamily(name, doc, labels=LABELS)  # exposed as <name>_total
            family.add_metric([model_name], info[key])
            yield family
    if info.get("total_blocks") is not None and info.get("block_size") is not None:
        config = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration, in the labels (vLLM's "
                                   "name; its blocks are in host memory).",
                                   labels=(*LABELS, "block_size", "num_gpu_blocks", "cache_dtype",
                                           "enable_prefix_caching"))
        config.add_metric([model_name, str(info["block_size"]), str(info["total_blocks"]),
                           str(info.get("kv_cache_dtype") or "auto"), str(bool(info.get("prefix_caching")))], 1.0)
        yield config
    yield _lora(info, model_name)


def _lora(info: dict[str, Any], model_name: str) -> Metric:
    """``vllm:lora_requests_info``: the value is the time of this reading; the labels name the adapter slots and
    the adapters of the running and of the waiting requests (comma-separated, as vLLM writes them)."""
    lora = info.get("lora") or {}
    family = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters in use: running and waiting requests' "
                               "adapters (labels); the value is the reading's Unix time (vLLM's name).",
                               labels=(*LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"))
    family.add_metric([model_name, str(lora.get("max_loras") or lora.get("slots") or 0),
                       ",".join(info.get("running_adapters") or ()), ",".join(info.get("waiting_adapters") or ())],
                      time.time())
    return family


def kv_usage(info: dict[str, Any]) -> float | None:
    """Fraction (0..1) of the KV-cache blocks in use (None: the engine does not say)."""
    free, total = info.get("free_blocks"), info.get("total_blocks")
    if free is None or not total:
        return None
    return 1.0 - free / total


class HistogramAliases:
    """Our latency histograms again under vLLM's names (``HISTOGRAM_NAMES``), read from ``registry``'s own
    collectors at scrape time."""

    def __init__(self, histograms: Iterable[Any]) -> None:
        self._histograms = tuple(histograms)

    def collect(self) -> Iterable[Metric]:
        for histogram in self._histograms:
            for family in histogram.collect():
                alias = HISTOGRAM_NAMES.get(family.name)
                if alias is None:
                    continue
                renamed = Metric(alias, family.documentation + " (vLLM's name)", family.type, family.unit)
                renamed.samples = [s._replace(name=alias + s.name[len(family.name):]) for s in family.samples
                                   if not s.name.endswith("_created")]
                yield renamed
