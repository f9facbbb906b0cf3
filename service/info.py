"""The JSON documents about the server: ``/info`` (the reference server's shape) and ``/v1/models``."""
from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

from backends.chat_format import tool_call_source
from service.context import AppContext

DEVICE_TYPE = "cpu"
PIPELINE_TAG = "text-generation"
MAX_BEST_OF = 1  # best_of > 1 is not supported


@functools.cache
def version() -> str:
    """mindserve's installed version (setup.cfg)."""
    try:
        return metadata.version("mindserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def server_info(ctx: AppContext) -> dict[str, Any]:
    """``GET /info``: the reference server's fields (null where mindserve has no such knob), then ours. The
    top-level figures are the first model's (the one routes without a ``model`` field serve); ``models`` has
    every model, ``mindserve.models`` their load state."""
    engine = ctx.backend.info()
    others = [slot.backend.info() for slot in ctx.models.slots[1:]]
    return {
        "docker_label": None,
        "max_batch_total_tokens": engine.get("max_prefill_tokens"),
        "max_best_of": MAX_BEST_OF,
        "max_concurrent_requests": engine.get("max_batch_size"),
        "max_stop_sequences": _max_stop_sequences(ctx),
        "max_waiting_tokens": None,
        "sha": None,
        "validation_workers": None,
        "version": version(),
        "waiting_served_ratio": None,
        "models": [_model_entry(ctx.backend.model_name, engine),
                   *(_model_entry(slot.name, info) for slot, info in zip(ctx.models.slots[1:], others))],
        "max_input_length": engine.get("max_input_tokens"),
        "mindserve": {
            "ready": ctx.state.ready,
            "arch": engine.get("arch"),
            "cache_blocks_free": engine.get("free_blocks"),
            "cache_blocks_total": engine.get("total_blocks"),
            "cache_block_size": engine.get("block_size"),
            "running": engine.get("running"),
            "waiting": engine.get("waiting"),
            "priorities": {str(p): n for p, n in (engine.get("priorities") or {}).items()},
            "compiled_graphs": engine.get("compiled_graphs"),
            "device": engine.get("device"),
            "threads": engine.get("threads"),
            "kernels": engine.get("kernels"),
            "kernel_variant": engine.get("kernel_variant"),
            "weight_dtype": engine.get("weight_dtype"),
            "kv_cache_dtype": engine.get("kv_cache_dtype"),
            "accepted_part_types": ctx.accepted_part_types() if ctx.state.ready else None,
            "prefix_cache": {
                "enabled": engine.get("prefix_caching"),
                "hit_rate": engine.get("prefix_cache_hit_rate"),
                "hit_tokens": engine.get("prefix_cache_hit_tokens"),
                "cached_blocks": engine.get("prefix_cache_blocks"),
            },
            "lora": {**(engine.get("lora") or {"slots": 0}), "adapters": engine.get("adapters") or []},
            "speculation": engine.get("speculation") or {"enabled": None},
            "http": http_gauges(ctx),
            "tool_call_format": tool_call_source(getattr(ctx.backend, "chat_template", None),
                                                 ctx.settings.chat_formats(ctx.backend.model_name)[0]),
            "max_loaded_models": ctx.models.limit,
            "models": ctx.models.describe(),
        },
    }


def _model_entry(name: str, engine: dict[str, Any]) -> dict[str, Any]:
    """One model of ``/info``'s ``models`` (the reference server's fields)."""
    return {"model_device_type": (engine.get("device") or DEVICE_TYPE).lower(), "model_dtype": engine.get("dtype"),
            "model_id": name, "model_pipeline_tag": PIPELINE_TAG, "model_sha": None,
            "max_total_tokens": engine.get("max_seq_len")}


def http_gauges(ctx: AppContext) -> dict[str, int]:
    """Where the requests and connections of this process are: slots, the line, bodies being read."""
    return {
        "slots_in_use": ctx.admission.in_flight,
        "slots_total": ctx.admission.max_in_flight,
        "waiting_for_slot": ctx.admission.waiting,
        "reading_body": ctx.connections.reading,
        "open_connections": ctx.connections.open_connections,
    }


def _max_stop_sequences(ctx: AppContext) -> int | None:
    """The ``maxItems`` of ``parameters.stop`` in the schema the server validates with."""
    stop = ctx.schemas.schema("parameters").get("properties", {}).get("stop", {})
    return stop.get("maxItems")


def model_card(ctx: AppContext, name: str | None = None) -> dict[str, Any]:
    """One entry of ``GET /v1/models`` (OpenAI's model object): model ``name`` (default: the first)."""
    return {"id": name or ctx.backend.model_name, "object": "model", "created": int(ctx.state.started_at),
            "owned_by": ctx.settings.owned_by}


def adapter_card(ctx: AppContext, adapter: dict[str, Any], base: str | None = None) -> dict[str, Any]:
    """A LoRA adapter's entry of ``GET /v1/models``: its parent is its base model ``base`` (default: the first),
    as vLLM lists them."""
    base = base or ctx.backend.model_name
    return {"id": adapter["name"], "object": "model", "created": int(ctx.state.started_at),
            "owned_by": ctx.settings.owned_by, "parent": base, "root": base}


def model_list(ctx: AppContext) -> dict[str, Any]:
    """Every model, each followed by its LoRA adapters."""
    return {"object": "list", "data": [card for slot in ctx.models.slots for card in (
        model_card(ctx, slot.name), *(adapter_card(ctx, a, slot.name) for a in slot.backend.adapters()))]}
