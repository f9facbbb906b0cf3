"""vocab.cc from Python: ``scan_rows`` (argmax, log-sum-exp and the k best of logits rows in one pass over them, on
the kernel pool) and ``native_scanner``, the ``sampling.RowScanner`` the engine's choosers use with it."""
from __future__ import annotations

import ctypes
import os

import numpy as np

from backends.sampling import RowScan, RowScanner

MAX_BEST = 256  # vocab.cc kMaxBest: the most best ids one scan keeps per row


def _entry(lib: ctypes.CDLL):
    fn = lib.mindserve_vocab_scan
    if fn.argtypes is None:
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4
        fn.restype = ctypes.c_int
    return fn


def scan_rows(logits: np.ndarray, k: int = 0, lib: ctypes.CDLL | None = None,
              cache_dir: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows of float32 ``logits`` [R, V] (rows may be strided, each row contiguous): (argmax [R] int32, log-sum-exp
    [R] float64, best ids [R, k] int32, best values [R, k] float32), best first (value descending, then id
    ascending; a row shorter than k ends in id -1, value -inf). ``lib`` defaults to ``kernel_library(cache_dir)``."""
    from backends.mindspore.kernels import kernel_library

    rows = np.asarray(logits)
    if rows.dtype != np.float32 or rows.ndim != 2 or rows.strides[1] != 4 or rows.strides[0] % 4:
        raise ValueError(f"scan_rows takes float32 rows, each contiguous; got {rows.dtype} {rows.shape} "
                         f"strides {rows.strides}")
    if not 0 <= k <= MAX_BEST:
        raise ValueError(f"scan_rows keeps at most {MAX_BEST} best ids a row, asked for {k}")
    r, v = rows.shape
    argmax, lse = np.empty(r, np.int32), np.empty(r, np.float64)
    ids, vals = np.empty((r, k), np.int32), np.empty((r, k), np.float32)
    stride = rows.strides[0] // 4 if r > 1 else v
    rc = _entry(lib or kernel_library(cache_dir))(rows.ctypes.data, r, stride, v, k, argmax.ctypes.data,
                                                  lse.ctypes.data, ids.ctypes.data, vals.ctypes.data)
    if rc != 0:
        raise ValueError(f"mindserve_vocab_scan refused rows {rows.shape}, k {k} (code {rc})")
    return argmax, lse, ids, vals


def native_scanner(lib: ctypes.CDLL) -> RowScanner:
    """A ``RowScanner`` on ``lib``'s kernel: None for a row that is not float32 or contiguous, or k > MAX_BEST."""

    def scan(row: np.ndarray, k: int) -> RowScan | None:
        if row.dtype != np.float32 or row.ndim != 1 or row.strides[0] != 4 or k > MAX_BEST or row.size == 0:
            return None
        argmax, lse, ids, vals = scan_rows(row.reshape(1, -1), k, lib)
        keep = ids[0] >= 0
        return RowScan(int(argmax[0]), float(lse[0]), ids[0][keep].astype(np.int64),
                       vals[0][keep].astype(np.float64))

    return scan
