"""What both kernel paths' networks share: parameters from host arrays, the rotary tables, RMSNorm."""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero

from backends.mindspore.kv_dtype import row_bytes
from backends.mindspore.load_clock import timed
from backends.mindspore.quant import QuantWeight

log = logging.getLogger("mindserve.engine")
DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def param(array: np.ndarray | QuantWeight, name: str, dtype=ms.float32) -> Parameter:
    if isinstance(array, QuantWeight):  # the embedding of a quantized conversion: dequantized once
        array = array.dequantize()
    array = np.ascontiguousarray(array, dtype=np.float32)
    return host_param(array, name) if dtype == ms.float32 else host_param(Tensor(array, dtype), name)


def host_param(array: np.ndarray | Tensor, name: str) -> Parameter:
    """A Parameter of a host array in its own dtype, made from the NumPy array itself: ``Parameter(Tensor(array))``
    copies it twice and took 25 times as long (MindSpore 2.9: 4.9 s of CPU for a 400 MB embedding, 0.19 s)."""
    return Parameter(array, name=name, requires_grad=False)


@timed("embedding")
def aot_param(array: np.ndarray | QuantWeight, name: str) -> Parameter:
    """``param`` for an AOT network: GGUF blocks (a quantized conversion's embedding) dequantized by the kernel
    library (pack.cc: quant.dequantize's bits, on the kernel threads)."""
    if isinstance(array, QuantWeight):
        from backends.mindspore.kernels import dequantize_qweight

        q = array
        return filled_param(q.shape, ms.float32, name, lambda out: dequantize_qweight(q, out=out))
    return param(array, name)


def _stacked(parts: list[np.ndarray | QuantWeight]) -> np.ndarray:
    """HF [out, in] matrices stacked along their outputs (q, k, v -> qkv), as [in, out] float32."""
    arrays = [p.dequantize() if isinstance(p, QuantWeight) else p for p in parts]
    return (arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)).T  # one part: no copy


def stock_weight(parts: list[np.ndarray | QuantWeight], name: str, dtype=ms.float32) -> Parameter:
    """A MatMul weight: [in, out] in ``dtype`` (GGUF blocks dequantized once, here)."""
    return param(_stacked(parts), name, dtype)


@timed("pack weights")
def aot_weight(parts: list[np.ndarray | QuantWeight], name: str) -> Parameter:
    """An AOT matmul weight: GGUF blocks stay quantized, each part in its own format (one format: prepare_qweight
    writes straight into the Parameter; a stack whose parts ship in different formats, e.g. Q4_K_M's Q6_K attn_v
    beside Q4_K q and k, is a segmented weight: prepare_qstack), else float32 in the kernel's packed layout."""
    from backends.mindspore.kernels import packed_shape, prepare_qstack, prepare_qweight, prepare_weight
    from backends.mindspore.quant import stack_segments

    if all(isinstance(p, QuantWeight) for p in parts):
        runs = stack_segments(parts)
        if len(runs) > 1:
            return host_param(prepare_qstack(parts), name)
        q = runs[0]
        return filled_param(packed_shape(q), ms.uint8, name, lambda out: prepare_qweight(q, out=out))
    return param(prepare_weight(_stacked(parts)), name)


@timed("pack weights")
def aot_experts(experts: list[list[np.ndarray | QuantWeight]], name: str) -> Parameter:
    """Routed experts' matrices (per expert the parts ``aot_weight`` stacks, e.g. gate and up) as one Parameter
    [E, ...]: each expert's ``aot_weight`` layout (GGUF blocks kept when every expert's packing has one shape, else
    packed float32) one after the other, so expert e's weight is slice e."""
    from backends.mindspore.kernels import prepare_qstack, prepare_weight

    if all(isinstance(p, QuantWeight) for parts in experts for p in parts):
        packed = [prepare_qstack(parts) for parts in experts]
        if len({p.shape for p in packed}) == 1:
            return host_param(np.concatenate(packed), name)
    return param(np.concatenate([prepare_weight(_stacked(parts)) for parts in experts]), name)


def stock_experts(experts: list[list[np.ndarray | QuantWeight]], name: str, dtype=ms.float32) -> Parameter:
    """Routed experts' matrices as one batched-matmul weight [E, in, out] in ``dtype`` (blocks dequantized)."""
    return param(np.stack([_stacked(parts) for parts in experts]), name, dtype)


def zeros_param(shape: tuple[int, ...], dtype, name: str) -> Parameter:
    """A Parameter of zeros in ``dtype``, allocated by MindSpore itself (``init=Zero()``): no host array, no float32
    detour, no copy. Measured (MindSpore 2.9, a 1 GiB float16 cache): 0.00 s to build, its pages untouched until
    written, where ``Tensor(np.zeros(float32), float16)`` took 5 s of CPU and twice the memory."""
    return Parameter(Tensor(shape=shape, dtype=dtype, init=Zero()), name=name, requires_grad=False)


def filled_param(shape: tuple[int, ...], dtype, name: str, fill: Callable[[np.ndarray], object]) -> Parameter:
    """A Parameter ``fill`` writes in place: MindSpore allocates it (``zeros_param``) and ``fill`` gets a NumPy view
    of that memory, so a big weight is written once and never copied (``host_param`` copies it: for the 1.7B model's
    1.5 GB of packed weights and embedding, most of the load's CPU on a VM whose first touch of memory is slow). If
    this MindSpore hands out a copy rather than a view, the filled copy is set as the data."""
    p = zeros_param(shape, dtype, name)
    view = memory_view(p)
    if view is None:
        host = p.asnumpy()
        fill(host)
        p.set_data(Tensor(host))
        return p
    fill(view)
    return p


def memory_view(p: Parameter) -> np.ndarray | None:
    """A NumPy view of ``p``'s own memory (allocated now if it was not), the memory the kernels and graphs write
    and read; None where this MindSpore's ``asnumpy`` hands out a copy instead."""
    p.init_data()
    first, again = p.asnumpy(), p.asnumpy()
    return first if first.ctypes.data == again.ctypes.data else None


@timed("KV cache")
def kv_cache_param(kv_dtype: str, rows: int, head_dim: int, name: str) -> Parameter:
    """An empty KV cache of ``rows`` rows in ``kv_dtype`` (kv_dtype.py; the AOT attention kernel takes the format
    from its dtype): float32 / float16 / bfloat16 [rows, head_dim], or q8_0 blocks as uint8 [rows, row bytes].
    The runner maps its pages in the background once the network is built (``CacheWarmer``)."""
    if kv_dtype == "q8_0":
        return zeros_param((rows, row_bytes(kv_dtype, head_dim)), ms.uint8, name)
    return zeros_param((rows, head_dim), DTYPES[kv_dtype], name)


@timed("KV cache")
def cache_memory(net: nn.Cell, name: str = "KV caches") -> list[tuple[Parameter, np.ndarray | None]]:
    """Each KV cache Parameter of ``net`` (``*k_cache``, ``*v_cache``) with a NumPy view of its memory, the memory
    the kernels and graphs write and read (None where this MindSpore hands out a copy)."""
    caches = []
    for key, cache in net.parameters_and_names():
        if key.endswith(("k_cache", "v_cache")):
            caches.append((cache, memory_view(cache)))
            if caches[-1][1] is None:
                log.warning("KV cache %s: MindSpore hands out copies of it; its pages fault in as written", key)
    return caches


class CacheWarmer:
    """Maps the KV caches' pages (``populate``) in the background once started (the engine does, with
    ``EngineConfig.map_kv_cache``: a server config's ``mapKvCache``), block by block in the order the allocator
    hands blocks out (lowest first), two threads (each half of the caches), while the graphs compile; the runner's
    warm-up waits for the first ``wait_bytes`` of blocks (all of a cache up to that size), so a server is ready
    with the blocks its first requests take in memory. The blocks past those go on mapping after the server is
    ready, at idle priority (``SCHED_IDLE``: only on a core nothing else wants; a block written before its turn
    faults in as written). On these VMs a page's first write faults for ~36 us: a fresh 128-token block of the
    1.7B shape's float16 cache cost ~220 ms inside the step that first wrote it; mapping the whole 3 GiB cache
    ahead took 1-25 s (the VM's host maps memory it had taken back slowly). A block is rows
    [h * slots + block * size, + size) of every kv head h of every cache."""

    WAIT_BYTES = 4 << 30  # what the warm-up waits for: 3-8 s a GiB on these VMs

    def __init__(self, memories: list[np.ndarray], num_slots: int, block_size: int, blocks_at_once: int = 8,
                 threads: int = 2, wait_bytes: int = WAIT_BYTES) -> None:
        self.num_slots, self.step = num_slots, blocks_at_once * block_size
        self.total = sum(m.nbytes for m in memories)
        # the first slots (whole steps of blocks) the warm-up waits for: every slot when the caches fit wait_bytes
        fits = int(num_slots * wait_bytes / self.total) if self.total > wait_bytes else num_slots
        self.wait_slots = num_slots if fits >= num_slots else min(num_slots, max(self.step, fits - fits % self.step))
        self.mapped = [0] * threads  # bytes so far, per thread
        self.stopped = threading.Event()
        self.started = False
        self._first = [threading.Event() for _ in range(threads)]  # set once a thread has mapped its wait_slots
        self._threads = [threading.Thread(target=self._map, args=(i, memories[i::threads]), daemon=True,
                                          name=f"mindserve-cache-warmer-{i}") for i in range(threads)]

    def start(self) -> None:
        self.started = True
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> bool:
        """Wait for the mapping threads to end (after ``stopped`` is set); False if one is still running."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(deadline - time.monotonic(), 0.0))
        return not any(thread.is_alive() for thread in self._threads)

    def _map(self, i: int, memories: list[np.ndarray]) -> None:
        try:
            for first in range(0, self.wait_slots, self.step):
                if not self._populate(i, memories, first, min(first + self.step, self.wait_slots)):
                    return
            self._first[i].set()
            if self.wait_slots < self.num_slots:  # the rest: after the server is ready, on idle cores only, one
                _idle_priority()  # call per kv head of each cache (the fewest returns to Python: each takes the GIL)
                self._populate(i, memories, self.wait_slots, self.num_slots)
        finally:
            self._first[i].set()

    def _populate(self, i: int, memories: list[np.ndarray], start: int, stop: int) -> bool:
        """Slots [start, stop) of every kv head of ``memories``; False once stopped or refused by the kernel."""
        for memory in memories:
            for head in memory.reshape(-1, self.num_slots, memory.shape[-1]):
                if self.stopped.is_set():
                    return False
                span = head[start:stop]
                if not populate(span):
                    return False  # the kernel has no MADV_POPULATE_WRITE: the pages fault in as written
                self.mapped[i] += span.nbytes
        return True

    def is_alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def wait(self) -> None:
        """Until the first ``wait_slots`` of every cache are mapped (every page of a cache up to ``wait_bytes``),
        a progress line every 5 s (at once if never started)."""
        if not self.started:
            return
        started = time.perf_counter()
        waited = self.total * self.wait_slots / self.num_slots
        while not all(event.is_set() for event in self._first):
            for event in self._first:
                event.wait(5 / len(self._first))
            if not all(event.is_set() for event in self._first):
                log.info("mapping KV cache pages: %.2f of %.2f GiB", sum(self.mapped) / 2**30, waited / 2**30)
        if self.wait_slots == self.num_slots:
            for thread in self._threads:  # past their last span
                thread.join()
        rest = "" if self.wait_slots == self.num_slots else (
            f"; the other {(self.total - waited) / 2**30:.2f} GiB map at idle priority while the server runs")
        log.info("KV cache pages mapped: %.2f GiB (%.1fs waited after the warm-up)%s", sum(self.mapped) / 2**30,
                 time.perf_counter() - started, rest)


def _idle_priority() -> None:
    """The calling thread runs only when a core has nothing else to run (Linux ``SCHED_IDLE``; elsewhere, as
    before)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def populate(memory: np.ndarray) -> bool:
    """Map the pages of ``memory`` (contiguous, writable; the pages it shares at either end too) in one call,
    ``madvise(MADV_POPULATE_WRITE)``: the contents stay, no fault is left for the first writes. False where
    the kernel refuses (older than 5.14, not Linux)."""
    if not memory.nbytes:
        return True
    madvise = _madvise()
    if madvise is None:
        return False
    start = memory.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    length = -(-(memory.ctypes.data + memory.nbytes - start) // mmap.PAGESIZE) * mmap.PAGESIZE
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0


@functools.cache
def _madvise():
    """libc's ``madvise``, looked up once (a warmer calls ``populate`` once per kv head per 8 blocks of every
    cache), or None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


def head_norm_weights(spec, w: dict, p: str) -> np.ndarray | None:
    """Layer ``p``'s q and k head-norm weights [2, head_dim] (Qwen3's ``self_attn.q_norm`` / ``k_norm``), or None
    for a model without them."""
    if not spec.qk_norm:
        return None
    from backends.mindspore.weights import WeightsError

    names = [p + f"self_attn.{n}_norm.weight" for n in "qk"]
    missing = [n for n in names if n not in w]
    if missing:
        raise WeightsError(f"{spec.checkpoint}: {spec.arch} has q/k head norms, but the checkpoint lacks {missing}")
    rows = [np.asarray(w[n], np.float32).reshape(-1) for n in names]
    if any(r.shape != (spec.head_dim,) for r in rows):
        raise WeightsError(f"{spec.checkpoint}: {names[0]} / {names[1]} must have head_dim {spec.head_dim} values, "
                           f"got {[r.size for r in rows]}")
    return np.stack(rows)


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_pos, head_dim] in HF ``rotate_half`` layout (frequencies repeated over both halves)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.arange(max_pos, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class RMSNorm(nn.Cell):
    """Stock ops, in ``dtype``; the mean of squares in float32 below it (float16 overflows past 256)."""

    def __init__(self, weight: np.ndarray, eps: float, name: str, dtype=ms.float32) -> None:
        super().__init__()
        self.weight = param(weight, name, dtype)
        self.eps = eps
        self.eps_t = Tensor(np.array([eps], np.float32))
        self.dtype, self.low_precision = dtype, dtype != ms.float32

    def construct(self, x):
        if self.low_precision:
            x32 = ops.cast(x, ms.float32)
            normed = x32 * ops.rsqrt(ops.mean(x32 * x32, -1, keep_dims=True) + self.eps)
            return ops.cast(normed, self.dtype) * self.weight
        return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps) * self.weight


class AotRMSNorm(nn.Cell):
    """The AOT kernel's RMSNorm (float32); the fused ops read ``weight`` and ``eps_t`` themselves."""

    def __init__(self, weight: np.ndarray, eps: float, name: str, aot) -> None:
        super().__init__()
        self.weight = param(weight, name)
        self.eps_t = Tensor(np.array([eps], np.float32))
        self.aot = aot

    def construct(self, x):
        return self.aot.rmsnorm(x, self.weight, self.eps_t)


def lora_factors(spec, p: str, group: str, slots: int, rank: int, dtype=ms.float32) -> tuple[Parameter, Parameter]:
    """One group's adapter slots (lora_slots.py): a [S, K, G*R] and b [S, R, N], zeros until an adapter is
    loaded."""
    from backends.lora import BaseDims
    from backends.mindspore.lora_slots import group_shapes

    a_shape, b_shape = group_shapes(BaseDims.of(spec), group, slots, rank)
    return (param(np.zeros(a_shape, np.float32), p + f"lora_{group}_a", dtype),
            param(np.zeros(b_shape, np.float32), p + f"lora_{group}_b", dtype))
