"""The load's Parameters (network/common.py) hold what a compiled graph then reads: ``filled_param`` written in place
through a view of MindSpore's own memory (the packed GGUF weights and the dequantized embedding), ``zeros_param``
(the KV caches) zeros in their dtype, and a cache written by a kernel between two graph calls is read back."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # compiles graphs


def _gather():
    """A graph returning rows of a Parameter, as float32 (CPU's Gather takes no bfloat16)."""
    import mindspore as ms
    from mindspore import nn, ops

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

    class Gather(nn.Cell):
        def __init__(self, w) -> None:
            super().__init__()
            self.w = w

        def construct(self, rows):
            return ops.gather(ops.cast(self.w, ms.float32), rows, 0)

    return Gather


def test_a_graph_reads_what_fill_wrote_and_later_writes_too():
    import mindspore as ms
    from mindspore import Tensor

    from backends.mindspore.network.common import filled_param

    want = np.random.default_rng(0).standard_normal((3000, 700)).astype(np.float32)
    views = []

    def fill(out: np.ndarray) -> None:
        views.append(out)
        out[...] = want

    w = filled_param(want.shape, ms.float32, "w", fill)
    net = _gather()(w)
    rows = Tensor(np.array([0, 1234, 2999], np.int32))
    np.testing.assert_array_equal(net(rows).asnumpy(), want[[0, 1234, 2999]])
    views[0][1234] = -1.0  # the view is the Parameter's memory: what the AOT kernels rely on for the caches
    np.testing.assert_array_equal(net(rows).asnumpy()[1], np.full(700, -1.0, np.float32))


def test_the_packed_weight_is_prepare_qweights_bytes():
    import mindspore as ms

    from backends.mindspore.kernels import packed_shape, prepare_qweight
    from backends.mindspore.network.common import aot_weight
    from backends.mindspore.modeldir.quant import concat_rows, quantize

    rng = np.random.default_rng(1)
    parts = [quantize(rng.standard_normal((n, 512)).astype(np.float32), "q4_k") for n in (40, 24)]
    w = aot_weight(parts, "wqkv")
    stacked = concat_rows(parts)
    assert w.dtype == ms.uint8 and tuple(w.shape) == packed_shape(stacked)
    np.testing.assert_array_equal(w.asnumpy(), prepare_qweight(stacked))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "q8_0"])
def test_kv_caches_are_zeros_in_their_dtype(dtype):
    import mindspore as ms
    from mindspore import Tensor

    from backends.mindspore.planning.kv_dtype import row_bytes
    from backends.mindspore.network.common import kv_cache_param

    cache = kv_cache_param(dtype, 5000, 64, "k_cache")
    width = row_bytes(dtype, 64) if dtype == "q8_0" else 64
    assert tuple(cache.shape) == (5000, width)
    assert cache.dtype == {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16,
                           "q8_0": ms.uint8}[dtype]
    got = _gather()(cache)(Tensor(np.array([0, 4999], np.int32)))
    np.testing.assert_array_equal(got.asnumpy(), np.zeros((2, width), np.float32))


def _untouched(shape, dtype=np.uint8) -> np.ndarray:
    """Zeros in fresh anonymous pages, none mapped yet: np.zeros may take memory the process already touched (a
    long-lived test process's heap, whose mmap threshold has grown), and then no page is left to map."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, size), dtype).reshape(shape)


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_populate_maps_every_page_of_an_untouched_array_in_one_call():
    from backends.mindspore.runners.kv_pages import populate

    memory = _untouched(96 << 20)  # no page is mapped until written
    before = _resident_mib()
    if not populate(memory[1:]):  # an unaligned start is rounded in to the next page
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert _resident_mib() - before > 90
    assert not memory.any()  # zeros still


def test_the_runners_cache_views_are_the_caches_memory(tiny_model_dir):
    """cache_memory's views are what the graphs write: a generation's K/V rows show in them."""
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig
    from backends.types import RequestParams

    config = EngineConfig(max_seq_len=64, max_input_tokens=32, max_batch_size=1, max_iter_times=8, block_size=16,
                          prefill_chunk=16, window_buckets=(64,), batch_buckets=(1,), map_kv_cache=True)
    with Engine(tiny_model_dir, config) as engine:
        warmer = engine.runner.warmer  # mapKvCache: started at load, waited for by the warm-up
        assert warmer.started and not warmer.is_alive() and sum(warmer.mapped) == warmer.total > 0
        caches = engine.runner._caches
        assert caches and all(memory is not None for _, memory in caches)
        before = [np.count_nonzero(memory) for _, memory in caches]  # the warm-up wrote the scratch block
        engine.generate("hello there", RequestParams(max_new_tokens=2, do_sample=False))
        assert all(np.count_nonzero(memory) > n for (_, memory), n in zip(caches, before))


def test_the_cache_warmer_maps_every_block_of_every_cache():
    from backends.mindspore.runners.kv_pages import CacheWarmer, populate

    if not populate(np.zeros(4096, np.uint8)):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    slots, size = 8 * 256, 256  # 8 blocks of 256 slots, 3 kv heads, rows of 16 KiB: 96 MiB a cache
    caches = [_untouched((3 * slots, 16384)) for _ in range(2)]
    before = _resident_mib()
    warmer = CacheWarmer(caches, slots, size, blocks_at_once=3)
    warmer.start()
    warmer.wait()
    assert not warmer.is_alive() and sum(warmer.mapped) == warmer.total and _resident_mib() - before > 180
    assert not any(c.any() for c in caches)
    stopped = CacheWarmer([np.zeros((3 * slots, 16384), np.uint8)], slots, size)
    stopped.stopped.set()
    before = _resident_mib()
    stopped.start()
    stopped.wait()
    assert _resident_mib() - before < 10  # stopped before its first span


def test_the_warm_up_waits_for_the_first_blocks_and_the_rest_map_at_idle_priority(monkeypatch):
    """Caches past ``wait_bytes``: ``wait`` returns once the first blocks (whole steps of them) of every cache are
    mapped, while the others are held back; those then map in threads at SCHED_IDLE."""
    import os
    import threading
    import time

    from backends.mindspore.runners import kv_pages as common

    if not common.populate(np.zeros(4096, np.uint8)):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    slots, size, width = 16 * 64, 64, 4096  # 16 blocks of 64 slots, 2 kv heads, rows of 4 KiB: 8 MiB a cache
    caches = [np.zeros((2 * slots, width), np.uint8) for _ in range(3)]
    warmer = common.CacheWarmer(caches, slots, size, blocks_at_once=2, wait_bytes=sum(c.nbytes for c in caches) // 3)
    assert warmer.wait_slots == 4 * 64  # a third of 16 blocks is 5.3: whole steps of 2 blocks, 4
    gate, policies, real = threading.Event(), set(), common.populate

    def held(span):
        base = next(c for c in caches if c.ctypes.data <= span.ctypes.data < c.ctypes.data + c.nbytes)
        if (span.ctypes.data - base.ctypes.data) // width % slots >= warmer.wait_slots:
            policies.add(os.sched_getscheduler(0))
            gate.wait(30)  # a warmer that waited for these too would sit here 30 s, then count them all
        return real(span)

    monkeypatch.setattr(common, "populate", held)
    warmer.start()
    warmer.wait()  # returns with the gate shut: it did not wait for the blocks past wait_slots
    assert sum(warmer.mapped) == sum(c.nbytes for c in caches) * 4 // 16 and warmer.is_alive()
    gate.set()
    deadline = time.monotonic() + 60
    while warmer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not warmer.is_alive() and sum(warmer.mapped) == warmer.total
    assert policies == {os.SCHED_IDLE}
