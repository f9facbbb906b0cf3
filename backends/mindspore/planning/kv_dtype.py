"""The KV cache's storage format (the server config's ``kvCacheDtype``): the one home of its names, the bytes a
cache row takes, and which kernel path stores which. No MindSpore import (``memory.py`` and the preflight ask it).

Formats (``kernels/kv_format.h`` says how each is written and read): float32, float16, bfloat16, and q8_0
(llama.cpp's blocks of 32 int8 and one fp16 scale, 34 bytes per 32 values). The AOT kernels read every one; the
stock-op path keeps its cache in its compute dtype (float32 on CPU).
"""
from __future__ import annotations

KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].kvCacheDtype"
KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "q8_0")
# "auto" on the AOT kernels: the fastest format whose greedy ids on the golden prompts match float32's
# (docs/performance.md, "The KV cache dtype"; tests/backends/mindspore/test_kv_dtype_model.py checks the ids).
DEFAULT = "float16"
STOCK = "float32"  # the stock-op path's cache on CPU (its compute dtype)
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34


def cache_dtype(requested: str, stock: bool) -> str:
    """The format the cache is kept in for ``requested`` (``auto`` or a name) on the chosen kernel path; a
    ValueError naming the key when that path does not store it."""
    if requested != "auto" and requested not in KV_CACHE_DTYPES:
        raise ValueError(f"{KEY} {requested!r} is not one of auto, {', '.join(KV_CACHE_DTYPES)}")
    if stock:
        if requested not in ("auto", STOCK):
            raise ValueError(f"{KEY} {requested!r}: the stock-op kernel path keeps the KV cache in its compute dtype "
                             f"({STOCK}); the other formats are read by the AOT kernels only (kernels auto or aot on "
                             f"CPU). Set kvCacheDtype to auto or {STOCK}, or run the AOT kernels")
        return STOCK
    return DEFAULT if requested == "auto" else requested


def row_bytes(dtype: str, head_dim: int) -> int:
    """Bytes of one cache row (one kv head of one token) of ``head_dim`` values."""
    if dtype == "q8_0":
        return -(-head_dim // Q8_BLOCK) * Q8_BLOCK_BYTES
    return head_dim * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
