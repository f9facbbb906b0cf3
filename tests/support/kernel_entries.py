"""Calls of the kernel library's AOT entries on plain NumPy arrays, and one small case per entry with odd sizes
(tails everywhere), for the tests that run every build variant of the kernels against each other."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

# uint16 stands for MindSpore's bfloat16 (NumPy has none; only the KV caches use it: tests/support/kv_ref.py)
_DTYPES = {np.dtype(np.float32): b"float32", np.dtype(np.int32): b"int32", np.dtype(np.int64): b"int64",
           np.dtype(np.uint8): b"uint8", np.dtype(np.float64): b"float64", np.dtype(np.float16): b"float16",
           np.dtype(np.uint16): b"bfloat16"}


def dtype_name(a: np.ndarray) -> bytes:
    """The dtype MindSpore names for ``a``'s dtype."""
    return _DTYPES[a.dtype]


def call_entry(lib, entry: str, arrays: list[np.ndarray]) -> int:
    """``entry(nparam, params, ndims, shapes, dtypes, None, None)`` as MindSpore calls it; outputs are among
    ``arrays`` (written in place, like the inputs a kernel updates)."""
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    shape_arrays = [(ctypes.c_int64 * max(1, a.ndim))(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                     for s in shape_arrays])
    dtypes = (ctypes.c_char_p * n)(*[dtype_name(a) for a in arrays])
    fn = getattr(lib, entry)
    fn.restype = ctypes.c_int
    return fn(n, params, ndims, shapes, dtypes, None, None)


def call_aot(lib, entry: str, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> int:
    """``call_entry`` on the inputs (made contiguous: an already contiguous one is passed itself, so a kernel's
    in-place writes land in it) followed by the outputs."""
    return call_entry(lib, entry, [np.ascontiguousarray(a) for a in inputs] + list(outputs))


@dataclass(frozen=True)
class Case:
    """One call: ``entry`` on ``arrays`` (inputs then outputs, the outputs NaN-filled)."""

    name: str
    entry: str
    arrays: tuple[np.ndarray, ...]

    def run(self, lib) -> tuple[int, list[np.ndarray]]:
        """(return code, every array after the call), on copies: the case itself is never written."""
        arrays = [np.array(a, copy=True) for a in self.arrays]
        return call_entry(lib, self.entry, arrays), arrays


def _f32(rng, *shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _out(*shape) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def _qweight(fmt: str, n: int, k: int, rng) -> np.ndarray:
    from backends.mindspore.modeldir.quant import quantize  # gguf's for the 32-blocks, its own for the K-quants
    from tests.support.qpack_ref import pack_qweight  # NumPy: making the cases needs no library

    w = _f32(rng, n, k, scale=0.05)
    w[:, :32] += 0.02  # an offset block (Q4_1's min)
    return pack_qweight(quantize(w, fmt))


def _qstack(fmts: tuple[str, ...], rows: tuple[int, ...], k: int, rng) -> np.ndarray:
    """A segmented weight (kernels.prepare_qstack): parts of the given formats and rows stacked along the outputs."""
    from backends.mindspore.kernels import prepare_qstack
    from backends.mindspore.modeldir.quant import quantize

    parts = []
    for fmt, n in zip(fmts, rows):
        w = _f32(rng, n, k, scale=0.05)
        w[:, :32] += 0.02
        parts.append(quantize(w, fmt))
    return prepare_qstack(parts)


def _lora(rng, m: int, k: int, segs: list[int], rank: int = 3, slots: int = 2) -> list[np.ndarray]:
    g = len(segs) - 1
    a = _f32(rng, slots, k, g * rank, scale=1 / np.sqrt(k))
    b = _f32(rng, slots, rank, segs[-1], scale=1 / np.sqrt(rank))
    rows = np.array([i % (slots + 1) - 1 for i in range(m)], np.int32)  # base rows (-1) and each slot
    return [a, b, rows, np.array(segs, np.int32)]


def _x(rng, m: int, k: int) -> np.ndarray:
    x = _f32(rng, m, k, scale=2.0)
    x[0, :min(k, 32)] = 0.0  # a zero block (quantization amax 0), and signed zeros
    x[-1, 1::7] = -0.0
    return x


def _attention_inputs(rng, n: int, h: int, kv: int, d: int, bs: int, nb: int, bias: bool) -> dict:
    """One packed step of two sequences (table rows 0 and 1), and the cache rows each token writes."""
    from backends.mindspore.network.common import rope_tables

    num_blocks = 2 * nb + 3
    width, slots = (h + 2 * kv) * d, num_blocks * bs
    table = np.stack([rng.permutation(np.arange(1, num_blocks))[:nb] for _ in range(2)]).astype(np.int32)
    rows = (np.arange(n) >= n // 2).astype(np.int32)
    start = rng.integers(0, nb * bs - n, 2)
    pos = np.array([start[r] + i for i, r in enumerate(rows)], np.int32)
    slot = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
    cos_t, sin_t = rope_tables(d, nb * bs, 10000.0)
    return dict(qkv=_f32(rng, n, width), bias=_f32(rng, width) if bias else np.zeros(1, np.float32),
                cos=cos_t[pos].astype(np.float32), sin=sin_t[pos].astype(np.float32),
                k=_f32(rng, kv * slots, d), v=_f32(rng, kv * slots, d),
                write=(slot[:, None] + np.arange(kv) * slots).reshape(-1).astype(np.int32), table=table, pos=pos,
                rows=rows, meta=np.array([kv, bs, int(bias)], np.int32), cos_t=cos_t.astype(np.float32),
                sin_t=sin_t.astype(np.float32))


def cases(seed: int = 0) -> list[Case]:
    """Every AOT entry of the library on small odd shapes: fp32, the eight GGUF formats and segmented stacks of
    several, with and without the residual and LoRA inputs, attention with 1 and several kv heads, biased and
    plain QKV, a whole layer."""
    from backends.mindspore.kernels import prepare_weight

    rng = np.random.default_rng(seed)
    out: list[Case] = []
    m, k, n = 7, 77, 101
    x, w = _x(rng, m, k), prepare_weight(_f32(rng, k, n, scale=0.1))
    res = _f32(rng, m, n)
    out.append(Case("matmul-fp32", "MindserveMatMul", (x, w, _out(m, n))))
    out.append(Case("matmul-add-lora-fp32", "MindserveMatMulAdd",
                    (x, w, res, *_lora(rng, m, k, [0, 40, 101]), _out(m, n))))
    kq, nq = 96, 37
    xq, resq = _x(rng, 9, kq), _f32(rng, 9, nq)
    for fmt in ("q8_0", "q4_0", "q4_1"):
        wq = _qweight(fmt, nq, kq, rng)
        out.append(Case(f"matmul-{fmt}", "MindserveMatMul", (xq, wq, _out(9, nq))))
        out.append(Case(f"matmul-add-lora-{fmt}", "MindserveMatMulAdd",
                        (xq, wq, resq, *_lora(rng, 9, kq, [0, 5, 20, 37]), _out(9, nq))))
    kk = 512  # the K-quants' super-blocks of 256; the Q5 formats on the 32-block shape too
    xk, resk = _x(rng, 9, kk), _f32(rng, 9, nq)
    for fmt in ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k"):
        wq = _qweight(fmt, nq, kk, rng)
        out.append(Case(f"matmul-{fmt}", "MindserveMatMul", (xk, wq, _out(9, nq))))
        out.append(Case(f"matmul-add-lora-{fmt}", "MindserveMatMulAdd",
                        (xk, wq, resk, *_lora(rng, 9, kk, [0, 5, 20, 37]), _out(9, nq))))
        if not fmt.endswith("_k"):
            out.append(Case(f"matmul-{fmt}-k96", "MindserveMatMul", (xq, _qweight(fmt, nq, kq, rng), _out(9, nq))))
    # segmented stacks (parts in different formats): Q4_K_M's qkv (Q4_K q, k and a Q6_K v), and both activation
    # kinds with 32-block runs
    for tag, fmts, rows in [("q4_k-q6_k", ("q4_k", "q4_k", "q6_k"), (21, 5, 11)),
                            ("q8_0-q5_k-q4_1", ("q8_0", "q5_k", "q4_1"), (9, 17, 11))]:
        ws = _qstack(fmts, rows, kk, rng)
        out.append(Case(f"matmul-stack-{tag}", "MindserveMatMul", (xk, ws, _out(9, nq))))
        out.append(Case(f"matmul-add-lora-stack-{tag}", "MindserveMatMulAdd",
                        (xk, ws, resk, *_lora(rng, 9, kk, [0, 5, 20, 37]), _out(9, nq))))
    wide = _qweight("q4_1", 80, 64, rng)  # group pairs (two full groups of 16 columns) and a tail group
    out.append(Case("matmul-q4_1-pairs", "MindserveMatMul", (_x(rng, 13, 64), wide, _out(13, 80))))
    c = 45
    xc = _f32(rng, 5, c, scale=3.0)
    out.append(Case("rmsnorm", "MindserveRMSNorm", (xc, _f32(rng, c), np.array([1e-5], np.float32), _out(5, c))))
    gu = _f32(rng, 4, 2 * 37, scale=6.0)
    gu[0, :4] = [-120.0, 120.0, 0.0, -0.0]
    out.append(Case("swiglu", "MindserveSwiGLU", (gu, _out(4, 37))))
    for h, kv, d, bs, nb, bias in [(3, 1, 24, 4, 5, True), (4, 2, 40, 3, 6, False), (2, 2, 8, 1, 20, True)]:
        a = _attention_inputs(rng, 6, h, kv, d, bs, nb, bias)
        tag = f"h{h}-kv{kv}-d{d}-bs{bs}" + ("-bias" if bias else "")
        out.append(Case(f"qkv-rope-{tag}", "MindserveQKVRope",
                        (a["qkv"], a["cos"], a["sin"], _out(6, h, d), _out(6 * kv, d), _out(6 * kv, d))))
        out.append(Case(f"qkv-attention-{tag}", "MindserveQKVAttention",
                        (a["qkv"], a["bias"], a["cos"], a["sin"], a["k"], a["v"], a["write"], a["table"], a["pos"],
                         a["rows"], a["meta"], _out(6, h * d))))
        q = _f32(rng, 6, h, d)
        out.append(Case(f"paged-attention-{tag}", "MindservePagedAttention",
                        (q, a["k"], a["v"], a["table"], a["pos"], a["rows"], np.array([kv, bs], np.int32),
                         _out(6, h * d))))
    # the KV cache formats (kvCacheDtype): a q8_0 row of one full and one partial block
    from tests.support import kv_ref

    for fmt in ("float16", "bfloat16", "q8_0"):
        a = _attention_inputs(rng, 6, 4, 2, 40, 3, 6, True)
        k, v = kv_ref.encode(a["k"], fmt), kv_ref.encode(a["v"], fmt)
        out.append(Case(f"qkv-attention-{fmt}", "MindserveQKVAttention",
                        (a["qkv"], a["bias"], a["cos"], a["sin"], k, v, a["write"], a["table"], a["pos"], a["rows"],
                         a["meta"], _out(6, 4 * 40))))
        out.append(Case(f"paged-attention-{fmt}", "MindservePagedAttention",
                        (_f32(rng, 6, 4, 40), k, v, a["table"], a["pos"], a["rows"], np.array([2, 3], np.int32),
                         _out(6, 4 * 40))))
    # two prompt-chunk runs of 8 tokens over 64 keys (two of attention.cc's tiles) at the head dims it unrolls
    for h, kv, d in [(2, 2, 64), (2, 1, 128)]:
        a = _attention_inputs(rng, 16, h, kv, d, 16, 4, False)
        k, v = kv_ref.encode(a["k"], "float16"), kv_ref.encode(a["v"], "float16")
        out.append(Case(f"paged-attention-runs-d{d}", "MindservePagedAttention",
                        (_f32(rng, 16, h, d), k, v, a["table"], a["pos"], a["rows"], np.array([kv, 16], np.int32),
                         _out(16, h * d))))
    # 16 tokens of 4 kv heads (enough to write the heads' rows in parallel), the last two padding (slot 0)
    a = _attention_inputs(rng, 16, 8, 4, 24, 4, 8, False)
    write = a["write"].reshape(16, 4)
    write[-2:] = np.arange(4) * (2 * 8 + 3) * 4  # slot 0 of each head (its rows: num_blocks * bs = (2 nb + 3) bs)
    out.append(Case("qkv-attention-heads-parallel", "MindserveQKVAttention",
                    (a["qkv"], a["bias"], a["cos"], a["sin"], a["k"], a["v"], write.reshape(-1).copy(), a["table"],
                     a["pos"], a["rows"], a["meta"], _out(16, 8 * 24))))
    # a whole decoder layer (q4_1 qkv and down, fp32 o, q8_0 gate/up), and the embedding and head entries
    h, kv, d, ffn = 3, 1, 16, 40
    a = _attention_inputs(rng, 5, h, kv, d, 4, 5, True)
    cdim = 64
    xl = _f32(rng, 5, cdim)
    eps = np.array([1e-6], np.float32)
    layer = (xl, _f32(rng, cdim), eps, _qweight("q4_1", (h + 2 * kv) * d, cdim, rng), a["bias"], a["cos"], a["sin"],
             a["k"], a["v"], a["write"], a["table"], a["pos"], a["rows"], a["meta"],
             prepare_weight(_f32(rng, h * d, cdim, scale=0.1)), _f32(rng, cdim), _qweight("q8_0", 2 * ffn, cdim, rng),
             prepare_weight(_f32(rng, ffn, cdim, scale=0.1)), _out(5, cdim))
    out.append(Case("decoder-layer", "MindserveDecoderLayer", layer))
    vocab, width = 50, 64
    embed = _f32(rng, vocab, width)
    ids = rng.integers(0, vocab, 5).astype(np.int32)
    out.append(Case("embed-rope", "MindserveEmbedRope",
                    (ids, a["pos"], embed, a["cos_t"], a["sin_t"], _out(5, width), _out(5, d), _out(5, d))))
    head = prepare_weight(_f32(rng, width, vocab, scale=0.1))
    out.append(Case("norm-head", "MindserveNormHead",
                    (xl, _f32(rng, width), eps, np.array([4, 1], np.int32), head, _out(2, vocab), _out(5, width))))
    out.append(Case("norm-matmul-lora", "MindserveNormMatMul",
                    (xl, _f32(rng, width), eps, _qweight("q4_0", 33, width, rng), *_lora(rng, 5, width, [0, 33]),
                     _out(5, 33))))
    out.append(Case("swiglu-matmul-add", "MindserveSwiGLUMatMulAdd",
                    (_f32(rng, 5, 2 * 32, scale=3.0), _qweight("q8_0", width, 32, rng), xl, _out(5, width))))
    # Qwen3's q/k head norms: QKVAttention's and the layer's two optional trailing inputs
    a = _attention_inputs(rng, 6, 4, 2, 40, 3, 6, False)
    norms = (_f32(rng, 2, 40, scale=2.0), eps)
    out.append(Case("qkv-attention-qk-norm", "MindserveQKVAttention",
                    (a["qkv"], a["bias"], a["cos"], a["sin"], a["k"], a["v"], a["write"], a["table"], a["pos"],
                     a["rows"], a["meta"], *norms, _out(6, 4 * 40))))
    a = _attention_inputs(rng, 5, h, kv, d, 4, 5, False)
    out.append(Case("decoder-layer-qk-norm", "MindserveDecoderLayer",
                    (*layer[:4], a["bias"], a["cos"], a["sin"], a["k"], a["v"], a["write"], a["table"], a["pos"],
                     a["rows"], a["meta"], *layer[14:18], _f32(rng, 2, d, scale=2.0), eps, _out(5, cdim))))
    # Gemma 3: QKVAttention with a sliding window and a score scale (meta [5]), GeGLU, NormAdd, the Gemma layer
    a = _attention_inputs(rng, 6, 4, 2, 40, 3, 6, False)
    gmeta = np.array([2, 3, 0, 4, np.array([24.0 ** -0.5], np.float32).view(np.int32)[0]], np.int32)
    out.append(Case("qkv-attention-window", "MindserveQKVAttention",
                    (a["qkv"], a["bias"], a["cos"], a["sin"], a["k"], a["v"], a["write"], a["table"], a["pos"],
                     a["rows"], gmeta, *norms, _out(6, 4 * 40))))
    gu = _f32(rng, 5, 2 * 32, scale=3.0)
    gu[0, :3] = [-120.0, 120.0, -0.0]
    out.append(Case("geglu-matmul", "MindserveGeGLUMatMul", (gu, _qweight("q8_0", width, 32, rng), _out(5, width))))
    out.append(Case("norm-add", "MindserveNormAdd", (xl, _f32(rng, width), eps, _f32(rng, 5, width), _out(5, width))))
    a = _attention_inputs(rng, 5, h, kv, d, 4, 5, False)
    gmeta = np.array([kv, 4, 0, 3, np.array([20.0 ** -0.5], np.float32).view(np.int32)[0]], np.int32)
    out.append(Case("gemma-decoder-layer", "MindserveGemmaDecoderLayer",
                    (*layer[:4], a["bias"], a["cos"], a["sin"], a["k"], a["v"], a["write"], a["table"], a["pos"],
                     a["rows"], gmeta, layer[14], _f32(rng, cdim), layer[15], layer[16], layer[17], _f32(rng, cdim),
                     _f32(rng, 2, d, scale=2.0), eps, _out(5, cdim))))
    out += _moe_cases(rng, layer, a, eps)
    out += _load_cases(rng)
    return out


def _load_cases(rng) -> list[Case]:
    """pack.cc: random GGUF blocks of every format (odd N: a narrow last group of columns) packed and dequantized."""
    from backends.mindspore.kernels import kernel_constants
    from backends.mindspore.modeldir.quant import FORMATS
    from tests.support.qpack_ref import random_blocks

    out = []
    for code, fmt in enumerate(FORMATS):
        q = random_blocks(fmt, 21, 2, rng)  # finite scales: a NaN's payload after NaN + NaN is not specified
        meta = np.array([code], np.int32)
        out.append(Case(f"pack-{fmt}", "MindservePackQWeight",
                        (q.blocks, meta, np.full((1, 2 * kernel_constants().packed_bytes[fmt], 21), 0xAB, np.uint8))))
        out.append(Case(f"dequantize-{fmt}", "MindserveDequantize", (q.blocks, meta, _out(21, q.cols))))
    return out


def _moe_cases(rng, layer: tuple, a: dict, eps: np.ndarray) -> list[Case]:
    """moe.cc: routed experts of each weight format and of a segmented gate/up (5 experts, top-2 normalised, top-3
    not), and a MoE layer."""
    from backends.mindspore.kernels import prepare_weight

    c, f, e = 64, 32, 5
    x, nw = _f32(rng, 7, c, scale=2.0), _f32(rng, c)
    router = prepare_weight(_f32(rng, c, e))
    out = []
    for fmt in ("fp32", "q8_0", "q4_0", "stack", "q4_1"):
        if fmt == "fp32":
            gu = np.concatenate([prepare_weight(_f32(rng, c, 2 * f, scale=0.2)) for _ in range(e)])
            down = np.concatenate([prepare_weight(_f32(rng, f, c, scale=0.2)) for _ in range(e)])
        elif fmt == "stack":  # each expert's gate Q4_1 beside its up Q8_0: segmented
            gu = np.concatenate([_qstack(("q4_1", "q8_0"), (f, f), c, rng) for _ in range(e)])
            down = np.concatenate([_qweight("q4_0", c, f, rng) for _ in range(e)])
        else:
            gu = np.concatenate([_qweight(fmt, 2 * f, c, rng) for _ in range(e)])
            down = np.concatenate([_qweight(fmt, c, f, rng) for _ in range(e)])
        for top_k, norm in ((2, 1), (3, 0)):
            out.append(Case(f"moe-{fmt}-top{top_k}", "MindserveMoE",
                            (x, nw, eps, router, gu, down, np.array([top_k, norm], np.int32), _out(7, c))))
    out.append(Case("moe-decoder-layer", "MindserveMoEDecoderLayer",
                    (*layer[:14], layer[14], layer[15], router, gu, down, np.array([2, 1], np.int32),
                     _out(5, c))))
    return out
