"""``GET /v1/loads``: each model's load in SGLang's shape (``WorkerLoadResponse``), the one SMG polls of a worker it
does not classify as vLLM (``/v1/models`` ``owned_by`` other than "vllm"; deploy/fleet/README.md). One entry per
model, as SGLang gives one per data-parallel rank; ``?model=NAME`` keeps that model's. ``include`` (SGLang's
sections core, disagg, queues, memory) is accepted: only ``core`` exists here.
"""
from __future__ import annotations

import datetime
from typing import Any

from service.vllm_metrics import kv_usage


def worker_loads(slots: Any, model: str | None = None) -> dict[str, Any]:
    """The body of ``GET /v1/loads`` for the model ``slots`` (service/models.py), or only ``model``'s."""
    chosen = [slot for slot in slots if model is None or slot.name == model]
    loads = [model_load(rank, slot.name, slot.backend.info()) for rank, slot in enumerate(chosen)]
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "dp_rank_count": len(loads),
            "loads": loads}


def model_load(rank: int, name: str, info: dict[str, Any]) -> dict[str, Any]:
    """One model's ``SchedulerLoadSnapshot``: requests, KV-cache tokens (blocks × block size), the queued prompt
    tokens not found in the prefix cache, prefix-cache hit rate.

    ``gen_throughput`` is 0.0, SGLang's "no live figure", on purpose. SMG 1.13 divides each worker's queue by it
    (its expected wait, used for ``cache_aware``'s new prefixes, ``least_load`` and ``power_of_two``) and uses
    ``--least-load-default-throughput`` for every worker that reports none. A live decode rate differs between
    identical replicas, since it is 0.0 until the first decode step and rises with the batch: the replica that
    batched more looked faster, got the new prefixes, and batched more still. Measured on two replicas
    (bench/fleet_bench.py, cache_aware): 96/24 and 42/78 requests per replica with the live rate, 57/63 twice without,
    and prefix hits 26-39k against 47k tokens (deploy/fleet/README.md)."""
    running, waiting = info.get("running") or 0, info.get("waiting") or 0
    block = info.get("block_size") or 0
    total, free = info.get("total_blocks") or 0, info.get("free_blocks") or 0
    usage = kv_usage(info) or 0.0
    return {"dp_rank": rank, "model": name, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": info.get("waiting_prompt_tokens") or 0,
            "num_total_reqs": running + waiting, "num_used_tokens": (total - free) * block,
            "max_total_num_tokens": total * block, "token_usage": usage,
            "gen_throughput": 0.0,
            "cache_hit_rate": info.get("prefix_cache_hit_rate") or 0.0, "utilization": usage,
            "max_running_requests": info.get("max_batch_size") or 0}

