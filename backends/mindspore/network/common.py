"""What both kernel paths' networks share: parameters from host arrays, the rotary tables, RMSNorm."""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero

from backends.mindspore.planning.kv_dtype import row_bytes
from backends.mindspore.planning.load_clock import timed
from backends.mindspore.modeldir.quant import QuantWeight

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
    from backends.mindspore.modeldir.quant import stack_segments

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
    The runner maps its pages in the background once the network is built (``kv_pages.CacheWarmer``)."""
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


def head_norm_weights(spec, w: dict, p: str) -> np.ndarray | None:
    """Layer ``p``'s q and k head-norm weights [2, head_dim] (Qwen3's ``self_attn.q_norm`` / ``k_norm``), or None
    for a model without them."""
    if not spec.qk_norm:
        return None
    from backends.mindspore.modeldir.weights import WeightsError

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
    from backends.mindspore.network.lora_groups import group_shapes

    a_shape, b_shape = group_shapes(BaseDims.of(spec), group, slots, rank)
    return (param(np.zeros(a_shape, np.float32), p + f"lora_{group}_a", dtype),
            param(np.zeros(b_shape, np.float32), p + f"lora_{group}_b", dtype))
