"""The KV caches' pages mapped ahead of their first writes: ``CacheWarmer`` (background threads, the rest at idle
priority once the server is ready) and ``populate`` (one ``madvise(MADV_POPULATE_WRITE)`` call per span). Plain
memory, no MindSpore: the runner hands it NumPy views of the caches (``network/common.py``'s ``cache_memory``)."""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import threading
import time

import numpy as np

log = logging.getLogger("mindserve.engine")


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
                 threads: int = 2, wait_bytes: int = WAIT_BYTES, slots: list[int] | None = None) -> None:
        """``slots``: each memory's own slot count where they differ (a window pool's caches are smaller); its
        slots are mapped in proportion, alongside the others'."""
        self.num_slots, self.step = num_slots, blocks_at_once * block_size
        slots = slots or [num_slots] * len(memories)
        self.total = sum(m.nbytes for m in memories)
        # the first slots (whole steps of blocks) the warm-up waits for: every slot when the caches fit wait_bytes
        fits = int(num_slots * wait_bytes / self.total) if self.total > wait_bytes else num_slots
        self.wait_slots = num_slots if fits >= num_slots else min(num_slots, max(self.step, fits - fits % self.step))
        self.mapped = [0] * threads  # bytes so far, per thread
        self.stopped = threading.Event()
        self.started = False
        self._first = [threading.Event() for _ in range(threads)]  # set once a thread has mapped its wait_slots
        self._threads = [threading.Thread(target=self._map, args=(i, list(zip(memories, slots))[i::threads]),
                                          daemon=True,
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

    def _map(self, i: int, memories: list[tuple[np.ndarray, int]]) -> None:
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

    def _populate(self, i: int, memories: list[tuple[np.ndarray, int]], start: int, stop: int) -> bool:
        """Slots [start, stop) of every kv head of ``memories`` (of a smaller cache: that share of its slots);
        False once stopped or refused by the kernel."""
        for memory, slots in memories:
            lo, hi = start * slots // self.num_slots, stop * slots // self.num_slots
            for head in memory.reshape(-1, slots, memory.shape[-1]):
                if self.stopped.is_set():
                    return False
                span = head[lo:hi]
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
