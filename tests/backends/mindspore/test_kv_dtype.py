"""kvCacheDtype: which format each kernel path keeps, the bytes a cache row takes, and the memory budget counting
them (pure arithmetic: no model, no MindSpore)."""
from __future__ import annotations

import pytest

from backends.mindspore.planning.kv_dtype import DEFAULT, KEY, cache_dtype, row_bytes
from backends.mindspore.planning.memory import GIB, Available, Footprint, plan_cache
from backends.settings import EngineConfig


@pytest.mark.parametrize("requested,stock,kept", [
    ("auto", False, DEFAULT), ("float32", False, "float32"), ("float16", False, "float16"),
    ("bfloat16", False, "bfloat16"), ("q8_0", False, "q8_0"), ("auto", True, "float32"), ("float32", True, "float32"),
])
def test_the_format_kept_on_each_path(requested, stock, kept):
    assert cache_dtype(requested, stock) == kept


@pytest.mark.parametrize("requested", ["float16", "bfloat16", "q8_0"])
def test_the_stock_path_refuses_a_format_it_does_not_store_naming_the_key(requested):
    with pytest.raises(ValueError) as exc:
        cache_dtype(requested, stock=True)
    assert str(exc.value).startswith(f"{KEY} '{requested}': the stock-op kernel path keeps the KV cache in its compute")


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="'fp8' is not one of auto, float32, float16, bfloat16, q8_0"):
        cache_dtype("fp8", stock=False)


@pytest.mark.parametrize("dtype,head_dim,size", [
    ("float32", 64, 256), ("float16", 64, 128), ("bfloat16", 64, 128), ("q8_0", 64, 68), ("q8_0", 40, 68),
    ("q8_0", 32, 34), ("q8_0", 8, 34), ("float16", 8, 16),
])
def test_row_bytes(dtype, head_dim, size):
    """q8_0: 34 bytes (an fp16 scale, 32 int8) per 32 values or part of them."""
    assert row_bytes(dtype, head_dim) == size


def _smol(kv_dtype: str) -> Footprint:
    """SmolLM2-135M's cache: 30 layers, 3 kv heads, head_dim 64, K and V."""
    return Footprint(weights_bytes=538_000_000, bytes_per_token=2 * 30 * 3 * row_bytes(kv_dtype, 64),
                     kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype,sequences", [("float32", 9), ("float16", 18), ("q8_0", 34)])
def test_the_same_budget_holds_more_blocks_in_a_smaller_format(kv_dtype, sequences):
    """npuMemSize 1 GB, 20 blocks a sequence: room for 182 float32 blocks, twice as many float16 ones, 3.76 times
    as many q8_0 ones (68 / 256 of float32's bytes); less the scratch block, in whole sequences."""
    config = EngineConfig(max_seq_len=2560, max_batch_size=200, block_size=128, cache_gb=1.0)
    plan = plan_cache(config, _smol(kv_dtype), Available(200 * GIB, "MemAvailable"), 8192)
    assert (plan.max_batch_size, plan.num_blocks) == (sequences, sequences * 20 + 1)
    assert plan.cache_bytes <= GIB
    assert f"({kv_dtype})" in plan.describe()


def test_the_preflight_refuses_a_format_the_stock_path_does_not_store(tiny_model_dir):
    """validate-config and serve ask the same rule before anything is loaded; the server names the key."""
    from backends.mindspore.engine.preflight import KV_CACHE, PreflightError, check_model

    with pytest.raises(PreflightError) as exc:
        check_model(tiny_model_dir, EngineConfig(kernels="stock", kv_cache_dtype="q8_0"))
    assert exc.value.about == KV_CACHE
    assert exc.value.detail.startswith(" 'q8_0': the stock-op kernel path keeps the KV cache in its compute dtype")
