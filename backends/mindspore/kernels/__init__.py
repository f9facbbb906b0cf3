"""Hand-written CPU kernels for MindSpore, exposed as ``ops.Custom(func_type="aot")`` operators.

``aot_ops(heads, kv_heads, head_dim)`` returns every operator the network uses, an ``AotOps``: the fields, their
entries, inputs, outputs and what each computes are one table, ``ops.OPS`` (``print(ops.manual())``). All of them
compute each row the same way whatever else is in the batch.

``fast_matmul()`` returns an operator computing ``y[..., N] = x[..., K] @ W[K, N]`` (float32). The
weight is packed once at load time by ``prepare_weight(W)`` (``W`` given ``[in, out]`` like the
model's weights) into contiguous column panels, shape ``[1, K, N]``. It works in GRAPH_MODE Cells
(and PyNative). Each output row is computed with the same floating-point operations whatever the
batch holds, so a request's logits are bit-identical alone or batched.

    from backends.mindspore.kernels import fast_matmul, prepare_weight
    mm = fast_matmul(threads=2)   # build (cached) + create the op; reuse one op everywhere
    w = Parameter(Tensor(prepare_weight(w_kn)))
    y = mm(x, w)                  # inside construct(), like ops.matmul(x, w_kn)

The library's constants (the panel width, the quantized formats and their sizes, the column group, the segment
table's bounds, the longest attention head, the stats kinds) are read from the library (``kernel_constants()``);
``PANEL``, ``QGROUP``, ``PACKED_BYTES``, ``MAX_SEGMENTS``, ``SEGMENT_MAGIC`` and ``KERNEL_KINDS`` are those values.
"""
from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.mindspore.kernels.build import VARIANTS, KernelBuildError, build_kernel, choose_variant, default_cache_dir
from backends.mindspore.kernels.ops import OPS, AotOps, Geometry, build_ops

__all__ = ["fast_matmul", "aot_ops", "AotOps", "OPS", "prepare_weight", "prepare_qweight", "prepare_qstack",
           "kernel_constants", "KernelConstants", "qmatmul_isa", "dequantize_qweight", "packed_shape", "build_kernel",
           "set_kernel_threads", "kernel_library", "kernel_stats", "KernelBuildError",
           "default_cache_dir", "VARIANTS", "choose_variant", "kernel_variant",
           "active_library"]

_lib: dict[str, ctypes.CDLL] = {}
_active: list[str] = []  # the library the last fast_matmul() op uses; the default for the helpers
_constants: dict[str, KernelConstants] = {}


@dataclass(frozen=True)
class KernelConstants:
    """The library's constants (``mindserve_kernel_constants``: matmul.cc, qformat.h, pool.h)."""

    panel: int  # columns per packed float panel (prepare_weight)
    qgroup: int  # output columns per group of a packed quantized weight
    formats: tuple[str, ...]  # the quantized formats, in code order
    block: dict[str, int]  # weights per block of each format
    packed_bytes: dict[str, int]  # packed bytes per column per block of each format
    max_segments: int  # most runs of a segmented weight
    segment_magic: bytes  # a segmented weight's first bytes
    max_head_dim: int  # the longest attention head
    kinds: tuple[str, ...]  # kernel_stats kinds, in order


def kernel_constants(cache_dir: str | os.PathLike | None = None, variant: str | None = None) -> KernelConstants:
    """The constants of the library in use (any one already loaded in this process -- every build has the same --,
    else ``kernel_library(cache_dir, variant)``)."""
    if cache_dir is None and variant is None and (_active or _lib):
        path = _active[-1] if _active else next(iter(_lib))
        lib = kernel_library(None) if _active else _lib[path]
    else:
        lib = kernel_library(cache_dir, variant)
        path = next(p for p, loaded in _lib.items() if loaded is lib)
    if path not in _constants:
        raw = json.loads(lib.mindserve_kernel_constants().decode())
        formats = raw["formats"]
        _constants[path] = KernelConstants(
            panel=raw["panel"], qgroup=raw["qgroup"], formats=tuple(f["name"] for f in formats),
            block={f["name"]: f["block"] for f in formats},
            packed_bytes={f["name"]: f["packed_bytes"] for f in formats},
            max_segments=raw["max_segments"], segment_magic=int(raw["segment_magic"]).to_bytes(4, "little"),
            max_head_dim=raw["max_head_dim"], kinds=tuple(raw["kinds"]))
    return _constants[path]


_CONSTANT_NAMES = {"PANEL": "panel", "QGROUP": "qgroup", "PACKED_BYTES": "packed_bytes", "MAX_SEGMENTS": "max_segments",
                   "SEGMENT_MAGIC": "segment_magic", "KERNEL_KINDS": "kinds"}


def __getattr__(name: str):
    """``PANEL``, ``QGROUP``, ... : ``kernel_constants()``'s values (read when first asked for)."""
    if name in _CONSTANT_NAMES:
        return getattr(kernel_constants(), _CONSTANT_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_weight(w: np.ndarray) -> np.ndarray:
    """Pack a ``[K, N]`` weight for ``fast_matmul`` (done once, at load time): float32 ``[1, K, N]``.

    Columns are cut into panels of ``PANEL`` (the last one may be narrower) and each panel is
    stored row-major ``[K, width]``, one after the other, so a kernel thread streams one
    contiguous region. The leading 1 tells a packed weight apart from a plain ``[K, N]`` one.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"prepare_weight expects a [K, N] matrix, got shape {w.shape}")
    k, n = w.shape
    PANEL = kernel_constants().panel  # noqa: N806 (the library's constant)
    full = n // PANEL
    packed = np.empty(k * n, np.float32)  # each part written once, straight from w (no intermediate copies)
    body = w[:, :full * PANEL].reshape(k, full, PANEL).transpose(1, 0, 2)  # [panels, K, PANEL]
    packed[:body.size].reshape(body.shape)[...] = body
    packed[k * full * PANEL:].reshape(k, n - full * PANEL)[...] = w[:, full * PANEL:]  # the tail [K, N % PANEL]
    return packed.reshape(1, k, n)


def packed_shape(q) -> tuple[int, int, int]:
    """The shape of ``prepare_qweight(q)``: ``(1, K/B * P, N)``, B and P the format's block size and packed bytes."""
    c = kernel_constants()
    return 1, q.cols // c.block[q.fmt] * c.packed_bytes[q.fmt], q.rows


def prepare_qweight(q, cache_dir: str | os.PathLike | None = None, variant: str | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Pack a ``QuantWeight`` (GGUF blocks of a ``[N, K]`` matrix, HF layout) for the quantized matmul: uint8
    ``[1, K/B * P, N]`` (B the format's block size, P its packed bytes: ``kernel_constants()``), laid out as
    qformat.h describes: groups of 16 output columns, each holding, block after block, the quants of its columns
    dword-major (one 64-byte load = one dword of each of 16 columns; q8_0 quants stored + 128) and then their
    scales. The layout is the same on every CPU (only the kernels' instructions differ). Packed by the kernel
    library (pack.cc's MindservePackQWeight, on the kernel threads; ``kernel_library`` says which library), into
    ``out`` if given (a C-contiguous uint8 array of ``packed_shape(q)``, e.g. a Parameter's own memory)."""
    out = np.empty(packed_shape(q), np.uint8) if out is None else out
    _blocks_entry(kernel_library(cache_dir, variant), "MindservePackQWeight", q, out)
    return out


def dequantize_qweight(q, cache_dir: str | os.PathLike | None = None, variant: str | None = None,
                       out: np.ndarray | None = None) -> np.ndarray:
    """``quant.dequantize(q)`` -- the same float32 bits, ggml's operation order -- by the kernel library (pack.cc's
    MindserveDequantize, on the kernel threads): float32 ``[rows, cols]`` (into ``out`` if given)."""
    out = np.empty((q.rows, q.cols), np.float32) if out is None else out
    _blocks_entry(kernel_library(cache_dir, variant), "MindserveDequantize", q, out)
    return out


def _blocks_entry(lib: ctypes.CDLL, entry: str, q, out: np.ndarray) -> None:
    """``entry(blocks, fmt, out)`` called as MindSpore calls an AOT entry (pack.cc)."""
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{entry} writes a C-contiguous, writeable array, got one with flags {out.flags}")
    arrays = [np.ascontiguousarray(q.blocks), np.array([kernel_constants().formats.index(q.fmt)], np.int32), out]
    n = len(arrays)
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    rc = getattr(lib, entry)(n, (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]),
                             (ctypes.c_int * n)(*[a.ndim for a in arrays]),
                             (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                                    for s in shapes]),
                             (ctypes.c_char_p * n)(b"uint8", b"int32", out.dtype.name.encode()), None, None)
    if rc != 0:
        raise ValueError(f"{entry} refused a {q.fmt} [{q.rows}, {q.cols}] weight (code {rc}, pack.cc)")


def prepare_qstack(parts) -> np.ndarray:
    """Pack ``QuantWeight`` parts stacked along their outputs (q, k, v -> qkv; ``quant.stack_segments`` merges
    neighbours of one format) for the quantized matmul: one format is ``prepare_qweight``'s layout; several are a
    segmented weight (qformat.h): uint8 ``[1, L, N]`` with L the least odd length that holds the table
    (magic, count, then per run its format code, columns and the 64-byte-aligned offset of its own
    ``prepare_qweight`` packing) and the runs' packings. Each run keeps its format; the layout is ISA-neutral."""
    from backends.mindspore.modeldir.quant import QuantError, stack_segments

    runs = stack_segments(parts)
    if len(runs) == 1:
        return prepare_qweight(runs[0])
    c = kernel_constants()
    if len(runs) > c.max_segments:
        raise QuantError(f"a stack of {len(runs)} runs of formats {[r.fmt for r in runs]}: at most {c.max_segments}")
    packed = [prepare_qweight(r).reshape(-1) for r in runs]
    offsets, end = [], 8 + 16 * len(runs)
    for p in packed:
        offsets.append(-(-end // 64) * 64)
        end = offsets[-1] + p.size
    n = sum(r.rows for r in runs)
    rows = -(-end // n)
    rows += 1 - rows % 2  # odd: no single format's packed length is
    out = np.zeros(rows * n, np.uint8)
    table = [np.frombuffer(c.segment_magic, np.uint8), np.array([len(runs)], "<i4").view(np.uint8)]
    for r, off in zip(runs, offsets):
        table += [np.array([c.formats.index(r.fmt), r.rows], "<i4").view(np.uint8),
                  np.array([off], "<i8").view(np.uint8)]
    head = np.concatenate(table)
    out[:head.size] = head
    for p, off in zip(packed, offsets):
        out[off:off + p.size] = p
    return out.reshape(1, rows, n)


def qmatmul_isa(cache_dir: str | os.PathLike | None = None) -> str:
    """The instruction set of the quantized dot products in the built library (avx512-vnni, avx512bw, avx2,
    neon-dotprod, neon, scalar)."""
    return kernel_library(cache_dir).mindserve_qmatmul_isa().decode()


def active_library() -> str | None:
    """Path of the library the last ``fast_matmul()`` / ``aot_ops()`` ops use (None before any)."""
    return _active[-1] if _active else None


def kernel_variant(cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """``{"variant": build variant, "isa": vector backend}`` of the library in use (see ``kernel_library``)."""
    lib = kernel_library(cache_dir)
    return {"variant": lib.mindserve_kernel_variant().decode(), "isa": lib.mindserve_vec_isa().decode()}


def kernel_library(cache_dir: str | os.PathLike | None = None, variant: str | None = None) -> ctypes.CDLL:
    """The kernel library loaded in this process (the same handle MindSpore's dlopen gets).

    Without ``cache_dir`` and ``variant`` this is the library of the most recent ``fast_matmul()`` op (so
    thread settings and stats reach the kernel MindSpore actually runs), else the one of that cache and
    variant (``build.choose_variant``: default the best this CPU runs).
    """
    if cache_dir is None and variant is None and _active:
        path = _active[-1]
    else:
        path = str(build_kernel(cache_dir, variant=variant))
    if path not in _lib:
        lib = ctypes.CDLL(path)
        lib.mindserve_kernel_variant.restype = ctypes.c_char_p
        lib.mindserve_vec_isa.restype = ctypes.c_char_p
        lib.mindserve_kernel_constants.restype = ctypes.c_char_p
        want = choose_variant(variant).name if variant is not None else None
        if want is not None and lib.mindserve_kernel_variant().decode() != want:
            raise KernelBuildError(f"{path} is the {lib.mindserve_kernel_variant().decode()} build, not {want}")
        lib.mindserve_matmul_set_threads.argtypes = [ctypes.c_int]
        lib.mindserve_matmul_set_threads.restype = ctypes.c_int
        lib.mindserve_matmul_get_threads.restype = ctypes.c_int
        lib.mindserve_matmul_set_spin_us.argtypes = [ctypes.c_int]
        lib.mindserve_matmul_tune.argtypes = [ctypes.c_int64, ctypes.c_int]
        lib.mindserve_matmul_panel_width.restype = ctypes.c_int
        lib.mindserve_matmul_raw.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        lib.mindserve_matmul_add_raw.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        lib.mindserve_matmul_lora_raw.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
                                                  + [ctypes.c_int64] * 3)
        lib.mindserve_qmatmul_raw.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
                                              + [ctypes.c_int64] * 3)
        lib.mindserve_qmatmul_raw.restype = ctypes.c_int
        lib.mindserve_qmatmul_packed_raw.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                                                     + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3)
        lib.mindserve_qmatmul_packed_raw.restype = ctypes.c_int
        lib.mindserve_quantize_rows_raw.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
        lib.mindserve_quantize_rows_raw.restype = ctypes.c_int
        lib.mindserve_quantize_rows_k_raw.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
        lib.mindserve_quantize_rows_k_raw.restype = ctypes.c_int
        lib.mindserve_qmatmul_isa.restype = ctypes.c_char_p
        lib.mindserve_attention_raw.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8
        lib.mindserve_attention_raw.restype = ctypes.c_int
        lib.mindserve_attention_kv_raw.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_int]
        lib.mindserve_attention_kv_raw.restype = ctypes.c_int
        lib.mindserve_attention_window_raw.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8
                                                       + [ctypes.c_int, ctypes.c_int64, ctypes.c_float])
        lib.mindserve_attention_window_raw.restype = ctypes.c_int
        lib.mindserve_kernel_stats.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_uint64)] * 2 + [ctypes.c_int]
        _lib[path] = lib
    return _lib[path]


def kernel_stats(reset: bool = False, cache_dir: str | os.PathLike | None = None,
                 kind: str = "matmul") -> tuple[int, float]:
    """(calls, seconds spent inside one kind of kernel, see ``KERNEL_KINDS``) since the last reset, for
    this process."""
    calls, ns = ctypes.c_uint64(), ctypes.c_uint64()
    kernel_library(cache_dir).mindserve_kernel_stats(kernel_constants(cache_dir).kinds.index(kind), ctypes.byref(calls),
                                                     ctypes.byref(ns), int(reset))
    return calls.value, ns.value / 1e9


def set_kernel_threads(n: int, cache_dir: str | os.PathLike | None = None) -> int:
    """Kernel threads (the calling runtime thread included; the library starts with 2): the count in effect
    (at most pool.h's kMaxThreads). Which thread computes a chunk never changes a result bit."""
    return kernel_library(cache_dir).mindserve_matmul_set_threads(int(n))


def fast_matmul(cache_dir: str | os.PathLike | None = None, threads: int | None = None, variant: str | None = None):
    """An ``ops.Custom`` AOT operator: ``op(x, w)`` with x ``[..., K]`` and w ``prepare_weight([K, N])``.

    ``cache_dir`` holds the compiled library (default ``~/.cache/mindserve/kernels``); ``threads``
    sets the kernel's thread count (None keeps the current one, 2 in a fresh process); ``variant`` the
    build (``build.choose_variant``).
    """
    from mindspore import ops  # imported lazily: building the kernel does not need MindSpore

    path: Path = build_kernel(cache_dir, variant=variant)
    _active.append(str(path))
    if threads is not None:
        set_kernel_threads(threads)
    matmul = OPS[0]
    return ops.Custom(f"{path}:{matmul.entry}", out_shape=lambda *shapes: matmul.out_shape(None, *shapes),
                      out_dtype=matmul.out_dtype, func_type="aot")


def aot_ops(heads: int, kv_heads: int, head_dim: int, cache_dir: str | os.PathLike | None = None,
            variant: str | None = None) -> AotOps:
    """Every operator of the network (``ops.OPS``), from the library of ``variant`` (``build.choose_variant``)."""
    from mindspore import ops

    path: Path = build_kernel(cache_dir, variant=variant)
    _active.append(str(path))

    def custom(entry: str, out_shape, out_dtype):
        return ops.Custom(f"{path}:{entry}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")

    constants = kernel_constants(cache_dir, variant)
    return build_ops(custom, Geometry(heads, kv_heads, head_dim, constants.block["q8_0"],
                                      constants.packed_bytes["q8_0"]))
