"""heap.give_back: freed malloc memory held inside an arena (below a live allocation, so free() alone cannot shrink
the heap) leaves the resident set once given back."""
from __future__ import annotations

import ctypes
import platform

import pytest

from backends.heap import give_back

MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc_trim")
def test_freed_heap_memory_leaves_the_resident_set() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunk = 64 << 10  # below malloc's mmap threshold: from the heap, as a parser's many small allocations are
    blocks = [libc.malloc(chunk) for _ in range(128 * MIB // chunk)]
    pin = libc.malloc(chunk)  # above them: the heap's top stays in use
    for b in blocks:
        ctypes.memset(b, 1, chunk)  # resident
    before = _rss()
    for b in blocks:
        libc.free(b)
    kept = _rss()
    assert give_back()
    after = _rss()
    libc.free(pin)
    assert kept - after > 64 * MIB, (before, kept, after)
