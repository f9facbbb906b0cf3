"""Engine.close gives its memory back (device.free_network): a server that unloads and loads models
(maxLoadedModels) must not grow by a whole model per load. MindSpore's graph executor keeps a closed network's
cells and Parameters alive on its own; before the fix each load/close of this config kept ~300 MiB."""
from __future__ import annotations

import ctypes
import gc
from pathlib import Path

from backends.settings import EngineConfig

CONFIG = EngineConfig(max_seq_len=1024, max_input_tokens=768, max_batch_size=16, block_size=128, prefill_chunk=64,
                      batch_buckets=(1, 4, 16), cache_gb=0.25, kv_cache_dtype="auto", map_kv_cache=True)
CACHE_MIB = 256  # npuMemSize 0.25: the pages map_kv_cache makes resident


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def load_and_close(model_dir: Path) -> tuple[float, float]:
    """RSS (MiB) with the engine loaded and warmed up, and after it is closed and dropped."""
    from backends.mindspore.engine.engine import Engine

    engine = Engine(model_dir, CONFIG, model_name="m").start()
    loaded = rss_mib()
    engine.close()
    del engine
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return loaded, rss_mib()


def test_close_returns_the_network_memory(default_q4_dir):
    first_loaded, first_closed = load_and_close(default_q4_dir)
    assert first_loaded - first_closed > CACHE_MIB  # the cache (and the weights) went back at once
    closed = [load_and_close(default_q4_dir)[1] for _ in range(2)]
    # what stays per load/close is small (MindSpore keeps some graph bookkeeping): far below one cache
    assert closed[-1] - first_closed < CACHE_MIB / 2, (first_closed, closed)
