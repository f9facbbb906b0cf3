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
    tokens not found in the prefix cache, decode throughput, prefix-cache hit rate."""
    running, waiting = info.get("running") or 0, info.get("waiting") or 0
    block = info.get("block_size") or 0
    total, free = info.get("total_blocks") or 0, info.get("free_blocks") or 0
    usage = kv_usage(info) or 0.0
    return {"dp_rank": rank, "model": name, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": info.get("waiting_prompt_tokens") or 0,
            "num_total_reqs": running + waiting, "num_used_tokens": (total - free) * block,
            "max_total_num_tokens": total * block, "token_usage": usage,
            "gen_throughput": decode_throughput(info.get("steps") or {}),
            "cache_hit_rate": info.get("prefix_cache_hit_rate") or 0.0, "utilization": usage,
            "max_running_requests": info.get("max_batch_size") or 0}


def decode_throughput(steps: dict[str, Any]) -> float:
    """Tokens per second of the engine's decode-only steps since start-up (0.0 before the first)."""
    decode = steps.get("decode")
    if not decode or not decode["seconds"]["sum"]:
        return 0.0
    return decode["tokens"]["sum"] / decode["seconds"]["sum"]
