"""Hand-written CPU kernels for MindSpore, exposed as ``ops.Custom(func_type="aot")`` operators.

``fast_matmul()`` returns an operator computing ``y[..., N] = x[..., K] @ w[K, N]`` (float32, ``w``
stored ``[in, out]`` like the model's weights). It works in GRAPH_MODE Cells (and PyNative).
Each output row is computed with the same floating-point operations whatever the batch holds,
so a request's logits are bit-identical alone or batched.

    from backends.mindspore.kernels import fast_matmul
    mm = fast_matmul()            # build (cached) + create the op; reuse one op everywhere
    y = mm(x, w)                  # inside construct(), like ops.matmul(x, w)
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from backends.mindspore.kernels.build import KernelBuildError, build_kernel, default_cache_dir

__all__ = ["fast_matmul", "prepare_weight", "build_kernel", "set_kernel_threads", "kernel_library", "kernel_stats", "KernelBuildError",
           "default_cache_dir", "ENTRY"]

ENTRY = "MindserveMatMul"
_lib: dict[str, ctypes.CDLL] = {}
_active: list[str] = []  # the library the last fast_matmul() op uses; the default for the helpers


def prepare_weight(w):
    """The layout ``fast_matmul`` expects for a ``[K, N]`` float32 weight (done once, at load time)."""
    import numpy as np

    return np.ascontiguousarray(w, dtype=np.float32)


def _out_shape(x_shape, w_shape):
    return list(x_shape[:-1]) + [w_shape[-1]]


def _out_dtype(x_dtype, _w_dtype):
    return x_dtype


def kernel_library(cache_dir: str | os.PathLike | None = None) -> ctypes.CDLL:
    """The kernel library loaded in this process (the same handle MindSpore's dlopen gets).

    Without ``cache_dir`` this is the library of the most recent ``fast_matmul()`` op (so thread
    settings and stats reach the kernel MindSpore actually runs), else the default cache's one.
    """
    path = _active[-1] if cache_dir is None and _active else str(build_kernel(cache_dir))
    if path not in _lib:
        lib = ctypes.CDLL(path)
        lib.mindserve_matmul_set_threads.argtypes = [ctypes.c_int]
        lib.mindserve_matmul_set_threads.restype = ctypes.c_int
        lib.mindserve_matmul_get_threads.restype = ctypes.c_int
        lib.mindserve_matmul_set_spin_us.argtypes = [ctypes.c_int]
        lib.mindserve_matmul_tune.argtypes = [ctypes.c_int] * 5
        lib.mindserve_matmul_tune_pf_rows.argtypes = [ctypes.c_int]
        lib.mindserve_matmul_raw.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        lib.mindserve_matmul_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 2 + [ctypes.c_int]
        _lib[path] = lib
    return _lib[path]


def kernel_stats(reset: bool = False, cache_dir: str | os.PathLike | None = None) -> tuple[int, float]:
    """(calls, seconds spent inside the kernel) since the last reset, for this process."""
    calls, ns = ctypes.c_uint64(), ctypes.c_uint64()
    kernel_library(cache_dir).mindserve_matmul_stats(ctypes.byref(calls), ctypes.byref(ns), int(reset))
    return calls.value, ns.value / 1e9


def set_kernel_threads(n: int, cache_dir: str | os.PathLike | None = None) -> int:
    """Kernel threads (the calling runtime thread included); default 2 or $MINDSERVE_MATMUL_THREADS."""
    return kernel_library(cache_dir).mindserve_matmul_set_threads(int(n))


def fast_matmul(cache_dir: str | os.PathLike | None = None, threads: int | None = None):
    """An ``ops.Custom`` AOT operator: ``op(x, w)`` with x ``[..., K]`` and w ``[K, N]``, float32."""
    from mindspore import ops  # imported lazily: building the kernel does not need MindSpore

    path: Path = build_kernel(cache_dir)
    _active.append(str(path))
    if threads is not None:
        set_kernel_threads(threads)
    return ops.Custom(f"{path}:{ENTRY}", out_shape=_out_shape, out_dtype=_out_dtype, func_type="aot")
