"""Hand-written CPU kernels for MindSpore, exposed as ``ops.Custom(func_type="aot")`` operators.

``aot_ops(heads, kv_heads, head_dim)`` returns every operator the network uses (``AotOps``):

* ``matmul`` -- ``fast_matmul()`` below (a float32 weight from ``prepare_weight``, or a GGUF-quantized one,
  q8_0/q4_0/q4_1/q5_0/q5_1/q4_k/q5_k/q6_k, from ``prepare_qweight``, or a stack of parts in several of them,
  from ``prepare_qstack``: dequantized on the fly inside the dot product, qmatmul.cc);
  ``matmul_add(x, w, res)`` = ``res + x @ W`` (a residual connection without a separate Add; the residual is
  added once, after the product);
  ``matmul_lora`` / ``matmul_add_lora`` take four more inputs ``(a, b, rows, segs)`` and add each row's
  LoRA delta (multi-LoRA serving, lora.h);
* ``qkv_attention(qkv [N, (H+2KV)*D], bias [(H+2KV)*D] or [1], cos, sin [N, D], k_cache, v_cache
  [KV*S, D], write [N*KV] int32, table [R, NB] int32, pos [N] int32, rows [N] int32, meta [3] int32 =
  (KV, block_size, has_bias)) -> [N, H*D]`` (fused.cc): a layer's attention after the qkv projection in
  one op. The bias, the split and RoPE; this step's K/V rows written into the cache Parameters in place
  (row ``write[i * KV + h]`` gets head h of token i), on the calling thread, before any key is read, so
  the graph has no ScatterUpdate and no ordering to get right; then causal attention straight out of
  the paged cache (attention.cc) for N query tokens of any sequences (token i belongs to the sequence
  of table row ``rows[i]``). It reads only each token's real keys (0..pos), so its cost follows the
  sequence lengths, and tokens of several prompts can share one packed chunk;
* ``norm_matmul(x, w_norm, eps, W)`` = ``matmul(rmsnorm(x, w_norm, eps), W)`` and
  ``swiglu_matmul_add(gu, W, res)`` = ``matmul_add(swiglu(gu), W, res)`` in one launch each (fused.cc: the
  row-wise kernel into a scratch buffer, then the matmul entry itself, so any weight it takes and the
  ``_lora`` variants' four LoRA inputs work the same); the same bits as the two ops;
* ``decoder_layer(x, attn_norm, eps, wqkv, bias, cos, sin, k_cache, v_cache, write, table, pos, rows, meta,
  wo, ffn_norm, w_gate_up, w_down) -> [N, C]`` (fused.cc): a whole decoder layer without adapters in one
  op -- norm_matmul, qkv_attention, matmul_add, norm_matmul, swiglu_matmul_add called in order inside the
  kernel, on scratch buffers: the same bits as those five ops, one launch;
* ``embed_rope(ids, pos, embed, cos_t, sin_t) -> (x [N, C], cos [N, D], sin [N, D])`` (fused.cc): the
  embedding and rotary rows of every token (ids/pos of N elements, any shape), and ``norm_head(x, w_norm,
  eps, last [R], W) -> (logits [R, V], hidden [N, C])``: the final norm, the logit rows' gather and the LM
  head. With them and ``decoder_layer`` a step is 32 ops;
* ``embed_rope_packed(ids, pos, head, cos_t, sin_t)``: ``embed_rope`` with the embedding rows dequantized from a
  tied head's packed Q8_0 weight (vocab.cc; no float32 table);
* ``rmsnorm(x [..., C], w [C], eps [1]) -> [..., C]`` (fused.cc);
* ``moe(h, ffn_norm, eps, router, w_gate_up [E, ...], w_down [E, ...], meta [2] = (top_k, norm_topk)) -> [N, C]``
  (moe.cc): a routed-experts MLP with its residual (Qwen3-MoE): the norm, the router's softmax and top-k, then
  each expert some row chose on the block of those rows (each expert's slice of the stacked weights is one matmul
  weight, float32 or GGUF blocks: the other experts are never read); ``moe_decoder_layer(<decoder_layer's inputs up
  to ffn_norm>, router, w_gate_up, w_down, moe_meta, (qk_norm, qk_eps))``: a whole MoE layer as one op.
* ``gemma_decoder_layer(x, attn_norm, eps, wqkv, bias, cos, sin, k_cache, v_cache, write, table, pos, rows, meta [5],
  wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm, qk_norm, qk_eps) -> [N, C]`` (fused.cc): a Gemma 3
  layer in one op (the sliding window and score scale in meta, the post-norms before each residual add, GeGLU).

The library also keeps the parts the fused entries are made of as entries of their own
(``MindserveSwiGLU``, ``MindserveQKVRope``, ``MindservePagedAttention``): the tests check each fused entry
against its parts bit for bit, and the parts against NumPy.

All of them compute each row the same way whatever else is in the batch.

``fast_matmul()`` returns an operator computing ``y[..., N] = x[..., K] @ W[K, N]`` (float32). The
weight is packed once at load time by ``prepare_weight(W)`` (``W`` given ``[in, out]`` like the
model's weights) into contiguous column panels, shape ``[1, K, N]``. It works in GRAPH_MODE Cells
(and PyNative). Each output row is computed with the same floating-point operations whatever the
batch holds, so a request's logits are bit-identical alone or batched.

    from backends.mindspore.kernels import fast_matmul, prepare_weight
    mm = fast_matmul(threads=2)   # build (cached) + create the op; reuse one op everywhere
    w = Parameter(Tensor(prepare_weight(w_kn)))
    y = mm(x, w)                  # inside construct(), like ops.matmul(x, w_kn)
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.mindspore.kernels.build import VARIANTS, KernelBuildError, build_kernel, choose_variant, default_cache_dir

__all__ = ["fast_matmul", "aot_ops", "AotOps", "prepare_weight", "prepare_qweight", "prepare_qstack", "QGROUP",
           "qmatmul_isa", "KERNEL_KINDS", "PANEL", "dequantize_qweight", "packed_shape", "build_kernel",
           "set_kernel_threads", "kernel_library", "kernel_stats", "KernelBuildError",
           "default_cache_dir", "ENTRY", "VARIANTS", "choose_variant", "kernel_variant",
           "active_library"]

ENTRY = "MindserveMatMul"
_lib: dict[str, ctypes.CDLL] = {}
_active: list[str] = []  # the library the last fast_matmul() op uses; the default for the helpers


PANEL = 48  # columns per packed panel; must equal kPanel in matmul.cc (checked by the tests)


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
    full = n // PANEL
    packed = np.empty(k * n, np.float32)  # each part written once, straight from w (no intermediate copies)
    body = w[:, :full * PANEL].reshape(k, full, PANEL).transpose(1, 0, 2)  # [panels, K, PANEL]
    packed[:body.size].reshape(body.shape)[...] = body
    packed[k * full * PANEL:].reshape(k, n - full * PANEL)[...] = w[:, full * PANEL:]  # the tail [K, N % PANEL]
    return packed.reshape(1, k, n)


QGROUP = 16  # output columns per group of a packed quantized weight (kGroup in qmatmul.cc)
_QFORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")  # qmatmul.cc's format codes, in order
# Bytes per column per block (32 weights; K-quants: super-block of 256) of a packed weight (qmatmul.cc's header).
PACKED_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q4_k": 148, "q5_k": 180, "q6_k": 210}


def packed_shape(q) -> tuple[int, int, int]:
    """The shape of ``prepare_qweight(q)``: ``(1, K/B * P, N)``."""
    from backends.mindspore.modeldir.quant import BLOCK_SIZE

    return 1, q.cols // BLOCK_SIZE[q.fmt] * PACKED_BYTES[q.fmt], q.rows


def prepare_qweight(q, cache_dir: str | os.PathLike | None = None, variant: str | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Pack a ``QuantWeight`` (GGUF blocks of a ``[N, K]`` matrix, HF layout) for the quantized matmul: uint8
    ``[1, K/B * P, N]`` (B the format's block size, P = ``PACKED_BYTES``), laid out as qmatmul.cc's header
    describes: groups of 16 output columns, each holding, block after block, the quants of its columns
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
    arrays = [np.ascontiguousarray(q.blocks), np.array([_QFORMATS.index(q.fmt)], np.int32), out]
    n = len(arrays)
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    rc = getattr(lib, entry)(n, (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]),
                             (ctypes.c_int * n)(*[a.ndim for a in arrays]),
                             (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                                    for s in shapes]),
                             (ctypes.c_char_p * n)(b"uint8", b"int32", out.dtype.name.encode()), None, None)
    if rc != 0:
        raise ValueError(f"{entry} refused a {q.fmt} [{q.rows}, {q.cols}] weight (code {rc}, pack.cc)")


SEGMENT_MAGIC = b"MSQS"  # a segmented weight's first bytes (qmatmul.cc kSegMagic)
MAX_SEGMENTS = 8  # qmatmul.cc kMaxSegments


def prepare_qstack(parts) -> np.ndarray:
    """Pack ``QuantWeight`` parts stacked along their outputs (q, k, v -> qkv; ``quant.stack_segments`` merges
    neighbours of one format) for the quantized matmul: one format is ``prepare_qweight``'s layout; several are a
    segmented weight (qmatmul.cc's header): uint8 ``[1, L, N]`` with L the least odd length that holds the table
    (magic, count, then per run its format code, columns and the 64-byte-aligned offset of its own
    ``prepare_qweight`` packing) and the runs' packings. Each run keeps its format; the layout is ISA-neutral."""
    from backends.mindspore.modeldir.quant import QuantError, stack_segments

    runs = stack_segments(parts)
    if len(runs) == 1:
        return prepare_qweight(runs[0])
    if len(runs) > MAX_SEGMENTS:
        raise QuantError(f"a stack of {len(runs)} runs of formats {[r.fmt for r in runs]}: at most {MAX_SEGMENTS}")
    packed = [prepare_qweight(r).reshape(-1) for r in runs]
    offsets, end = [], 8 + 16 * len(runs)
    for p in packed:
        offsets.append(-(-end // 64) * 64)
        end = offsets[-1] + p.size
    n = sum(r.rows for r in runs)
    rows = -(-end // n)
    rows += 1 - rows % 2  # odd: no single format's packed length is
    out = np.zeros(rows * n, np.uint8)
    table = [np.frombuffer(SEGMENT_MAGIC, np.uint8), np.array([len(runs)], "<i4").view(np.uint8)]
    for r, off in zip(runs, offsets):
        table += [np.array([_QFORMATS.index(r.fmt), r.rows], "<i4").view(np.uint8),
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


def _out_shape(x_shape, w_shape):
    return list(x_shape[:-1]) + [w_shape[-1]]  # w is the packed [1, K, N]


def _out_dtype(x_dtype, _w_dtype):
    return x_dtype


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


KERNEL_KINDS = ("matmul", "attention", "rmsnorm", "swiglu", "qkv_rope")  # pool.h Kind, in order


def kernel_stats(reset: bool = False, cache_dir: str | os.PathLike | None = None,
                 kind: str = "matmul") -> tuple[int, float]:
    """(calls, seconds spent inside one kind of kernel, see ``KERNEL_KINDS``) since the last reset, for
    this process."""
    calls, ns = ctypes.c_uint64(), ctypes.c_uint64()
    kernel_library(cache_dir).mindserve_kernel_stats(KERNEL_KINDS.index(kind), ctypes.byref(calls),
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
    return ops.Custom(f"{path}:{ENTRY}", out_shape=_out_shape, out_dtype=_out_dtype, func_type="aot")


def _first_dtype(dtype, *_):
    return dtype


def _embed_rope_shapes(ids, _pos, embed, cos_t, _sin_t):
    n = int(np.prod(ids))
    return [n, embed[1]], [n, cos_t[1]], [n, cos_t[1]]


def _embed_rope_packed_shapes(ids, _pos, head, cos_t, _sin_t):
    n = int(np.prod(ids))
    return [n, head[1] // 34 * 32], [n, cos_t[1]], [n, cos_t[1]]  # head: a packed Q8_0 [1, C/32 * 34, V]


@dataclass(frozen=True)
class AotOps:
    """The network's AOT operators (module docstring), all from one library and one thread pool."""

    matmul: Any
    matmul_add: Any
    matmul_add_lora: Any  # matmul_add(x, w, res, a, b, rows, segs)
    qkv_attention: Any  # qkv_attention(qkv, bias, cos, sin, k_cache, v_cache, write, table, pos, rows, meta)
    norm_matmul: Any  # norm_matmul(x, w_norm, eps, w) = matmul(rmsnorm(x), w)
    norm_matmul_lora: Any  # norm_matmul(x, w_norm, eps, w, a, b, rows, segs)
    swiglu_matmul_add: Any  # swiglu_matmul_add(gu, w, res) = matmul_add(swiglu(gu), w, res)
    swiglu_matmul_add_lora: Any  # swiglu_matmul_add(gu, w, res, a, b, rows, segs)
    decoder_layer: Any  # the five ops above as one (no adapters)
    embed_rope: Any  # embed_rope(ids, pos, embed, cos_t, sin_t) -> (x, cos, sin)
    norm_head: Any  # norm_head(x, w_norm, eps, last_rows, head) -> (logits, hidden)
    rmsnorm: Any
    moe: Any  # moe(h, ffn_norm, eps, router, w_gate_up, w_down, meta) = h + experts(rmsnorm(h))
    moe_decoder_layer: Any  # attention half of decoder_layer, then moe, as one op
    gemma_decoder_layer: Any = None  # Gemma 3's layer as one op (fused.cc MindserveGemmaDecoderLayer)
    embed_rope_packed: Any = None  # embed_rope reading a tied Q8_0 head's packed weight (vocab.cc)


def aot_ops(heads: int, kv_heads: int, head_dim: int, cache_dir: str | os.PathLike | None = None,
            variant: str | None = None) -> AotOps:
    """Every operator of the network, from the library of ``variant`` (``build.choose_variant``)."""
    from mindspore import ops

    path: Path = build_kernel(cache_dir, variant=variant)
    _active.append(str(path))

    def custom(entry: str, out_shape, out_dtype=_first_dtype):
        return ops.Custom(f"{path}:{entry}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")

    return AotOps(
        matmul=custom(ENTRY, _out_shape, _out_dtype),
        matmul_add=custom("MindserveMatMulAdd", lambda x, w, r: _out_shape(x, w), _first_dtype),
        matmul_add_lora=custom("MindserveMatMulAdd", lambda x, w, *_: _out_shape(x, w)),
        qkv_attention=custom("MindserveQKVAttention", lambda qkv, *_: [qkv[0], heads * head_dim]),
        norm_matmul=custom("MindserveNormMatMul", lambda x, _nw, _eps, w: _out_shape(x, w)),
        norm_matmul_lora=custom("MindserveNormMatMul", lambda x, _nw, _eps, w, *_: _out_shape(x, w)),
        swiglu_matmul_add=custom("MindserveSwiGLUMatMulAdd", lambda gu, w, res: list(res)),
        swiglu_matmul_add_lora=custom("MindserveSwiGLUMatMulAdd", lambda gu, w, res, *_: list(res)),
        decoder_layer=custom("MindserveDecoderLayer", lambda x, *_: list(x)),
        embed_rope=custom("MindserveEmbedRope", _embed_rope_shapes, lambda _i, _p, emb, *_: (emb, emb, emb)),
        norm_head=custom("MindserveNormHead", lambda x, _w, _e, last, head: ([last[0], head[-1]], list(x)),
                         lambda x, *_: (x, x)),
        rmsnorm=custom("MindserveRMSNorm", lambda x, *_: list(x)),
        moe=custom("MindserveMoE", lambda h, *_: list(h)),
        moe_decoder_layer=custom("MindserveMoEDecoderLayer", lambda x, *_: list(x)),
        gemma_decoder_layer=custom("MindserveGemmaDecoderLayer", lambda x, *_: list(x)),
        embed_rope_packed=custom("MindserveEmbedRopePacked", _embed_rope_packed_shapes,
                                 lambda _i, _p, _h, cos_t, *_: (cos_t, cos_t, cos_t)),
    )
