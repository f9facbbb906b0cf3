"""What a gateway reads of a replica, without a model: the vLLM-named series on /metrics (each one of our own
figures under vLLM's name) and the body of GET /v1/loads (SGLang's shape), from an engine's ``info()``."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.loads import model_load, worker_loads
from service.metrics import EngineCollector, ServiceMetrics
from service.validation import default_schemas

MODEL = "tiny"
INFO = {"model_name": MODEL, "running": 3, "waiting": 2, "free_blocks": 30, "total_blocks": 40, "block_size": 16,
        "max_batch_size": 8, "prefix_cache_query_tokens": 500, "prefix_cache_hit_tokens": 200,
        "prefix_cache_hit_rate": 0.4, "prefix_caching": True, "kv_cache_dtype": "float32",
        "waiting_prompt_tokens": 77, "running_adapters": ["fr", "sql"], "waiting_adapters": ["fr"],
        "lora": {"slots": 2, "rank": 8, "max_loras": 2, "runtime_updates": False},
        "steps": {"decode": {"seconds": {"buckets": [], "count": 4, "sum": 2.0},
                             "tokens": {"buckets": [], "count": 4, "sum": 300}},
                  "prefill": {"seconds": {"buckets": [], "count": 1, "sum": 1.0},
                              "tokens": {"buckets": [], "count": 1, "sum": 64}}}}


def scrape(metrics: ServiceMetrics) -> dict[str, dict[tuple, float]]:
    """``{sample name: {sorted labels: value}}`` of the exposition text, parsed by Prometheus's own parser."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(samples: dict[str, dict[tuple, float]], name: str) -> float:
    (value,) = samples[name].values()
    return value


@pytest.fixture
def metrics() -> ServiceMetrics:
    m = ServiceMetrics(MODEL, lambda: INFO)
    for seconds in (0.003, 0.2, 4.0):
        m.ttft.observe(seconds)
        m.tpot.observe(seconds / 10)
        m.e2e.observe(seconds * 10)
    return m


@pytest.mark.parametrize(("ours", "vllm", "expected"), [
    ("num_requests_running", "vllm:num_requests_running", 3),
    ("num_requests_waiting", "vllm:num_requests_waiting", 2),
    ("cpu_cache_usage_perc", "vllm:kv_cache_usage_perc", 0.25),
])
def test_vllm_gauges_equal_ours(metrics, ours, vllm, expected):
    samples = scrape(metrics)
    assert one(samples, vllm) == one(samples, ours) == expected
    assert samples[vllm].keys() == samples[ours].keys() == {(("model_name", MODEL),)}


def test_prefix_cache_counters_count_prompt_tokens():
    samples = scrape(ServiceMetrics(MODEL, lambda: INFO))
    assert one(samples, "vllm:prefix_cache_queries_total") == 500
    assert one(samples, "vllm:prefix_cache_hits_total") == 200


def test_cache_config_and_lora_info_carry_their_figures_in_labels():
    samples = scrape(ServiceMetrics(MODEL, lambda: INFO))
    ((labels, value),) = samples["vllm:cache_config_info"].items()
    assert value == 1 and dict(labels) == {"model_name": MODEL, "block_size": "16", "num_gpu_blocks": "40",
                                           "cache_dtype": "float32", "enable_prefix_caching": "True"}
    ((labels, stamp),) = samples["vllm:lora_requests_info"].items()
    assert dict(labels) == {"model_name": MODEL, "max_lora": "2", "running_lora_adapters": "fr,sql",
                            "waiting_lora_adapters": "fr"}
    assert stamp > 1.7e9  # a Unix time


@pytest.mark.parametrize(("ours", "vllm"), [
    ("time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    ("time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    ("e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
])
def test_vllm_histograms_are_ours_renamed(metrics, ours, vllm):
    samples = scrape(metrics)
    for suffix in ("_bucket", "_count", "_sum"):
        assert samples[vllm + suffix] == samples[ours + suffix]
    assert one(samples, vllm + "_count") == 3
    assert vllm + "_created" not in samples


def test_an_engine_without_figures_gets_no_vllm_gauges():
    samples = scrape(ServiceMetrics(MODEL, lambda: {"model_name": MODEL}))
    assert not {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
                "vllm:prefix_cache_hits_total"} & samples.keys()
    assert "vllm:lora_requests_info" in samples  # no adapters: empty labels, still a reading


def test_several_models_each_get_their_series():
    metrics = ServiceMetrics(MODEL)
    metrics.registry.register(EngineCollector([("a", lambda: {**INFO, "running": 1}),
                                               ("b", lambda: {**INFO, "running": 5})]))
    samples = scrape(metrics)
    assert samples["vllm:num_requests_running"] == {(("model_name", "a"),): 1, (("model_name", "b"),): 5}


def test_loads_entry_from_engine_info():
    load = model_load(0, MODEL, INFO)
    default_schemas().validate("loads_response", {"timestamp": "t", "dp_rank_count": 1, "loads": [load]})
    assert load == {"dp_rank": 0, "model": MODEL, "num_running_reqs": 3, "num_waiting_reqs": 2,
                    "num_waiting_uncached_tokens": 77, "num_total_reqs": 5, "num_used_tokens": 160,
                    "max_total_num_tokens": 640, "token_usage": 0.25, "gen_throughput": 0.0,
                    "cache_hit_rate": 0.4, "utilization": 0.25, "max_running_requests": 8}


def test_loads_of_an_engine_that_reports_little_are_zero_not_missing():
    load = model_load(2, MODEL, {"running": 1})
    assert load["num_running_reqs"] == 1 and load["dp_rank"] == 2
    assert load["token_usage"] == load["gen_throughput"] == load["max_total_num_tokens"] == 0
    default_schemas().validate("loads_response", {"timestamp": "t", "dp_rank_count": 1, "loads": [load]})


def test_no_live_throughput_is_reported_whatever_the_engine_did():
    """SMG divides each worker's queue by ``gen_throughput``; identical replicas must report the same figure, so a
    replica with decode steps behind it reports what a fresh one does (service/loads.py says why)."""
    busy = {**INFO, "steps": {"decode": {"seconds": {"sum": 2.0}, "tokens": {"sum": 300}}}}
    assert INFO["steps"] and model_load(0, MODEL, busy)["gen_throughput"] == model_load(0, MODEL, {})[
        "gen_throughput"] == 0.0


def test_worker_loads_one_entry_per_model_or_the_one_asked():
    slots = [SimpleNamespace(name=n, backend=SimpleNamespace(info=lambda n=n: {**INFO, "running": len(n)}))
             for n in ("a", "bb")]
    body = worker_loads(slots)
    default_schemas().validate("loads_response", body)
    assert body["dp_rank_count"] == 2 and [(x["model"], x["num_running_reqs"]) for x in body["loads"]] == [
        ("a", 1), ("bb", 2)]
    only = worker_loads(slots, "bb")
    assert [(x["dp_rank"], x["model"]) for x in only["loads"]] == [(0, "bb")]
