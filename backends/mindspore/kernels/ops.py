"""The network's AOT operators, one table (``OPS``): each row is an ``AotOps`` field, the library entry it calls, its
inputs and outputs, what it computes, and MindSpore's output shape and dtype functions. ``AotOps`` and ``aot_ops()``
(``kernels/__init__.py``) are made from it, and its rows are the operators' manual (``print(manual())``).

Every operator computes each row the same way whatever else is in the batch, on one library and its one thread pool.
The library also keeps the parts the fused entries are made of as entries of their own (``MindserveSwiGLU``,
``MindserveQKVRope``, ``MindservePagedAttention``, ``MindserveNormAdd``, ``MindserveGeGLUMatMul``): the tests check
each fused entry against its parts bit for bit, and the parts against NumPy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass
from typing import Any, NamedTuple


class Geometry(NamedTuple):
    """What the operators' output shapes need: the attention shape, and the library's Q8_0 block size and packed
    bytes per block (``kernel_constants()``: a packed Q8_0 head [1, C/block * packed, V] gives C)."""

    heads: int
    kv_heads: int
    head_dim: int
    q8_block: int
    q8_packed: int


def _matmul_shape(x, w):
    return list(x[:-1]) + [w[-1]]  # w is the packed [1, K, N] (or [1, L, N] of GGUF blocks)


def _first(x, *_):
    return x


def _same_as_first(_geom, x, *_):
    return list(x)


@dataclass(frozen=True)
class Op:
    name: str  # the AotOps field
    entry: str  # the library's C symbol (fused_entries.cc, matmul.cc, moe.cc, vocab.cc)
    call: str  # inputs -> outputs
    does: str
    out_shape: Callable[..., Any] = field(repr=False)  # (Geometry, *input shapes) -> output shape(s)
    out_dtype: Callable[..., Any] = field(default=_first, repr=False)  # (*input dtypes) -> output dtype(s)


_LORA = "a [S, K, G*R], b [S, R, N], rows [M] (each row's slot, -1: none), segs [G + 1] (lora.h)"
_ATTENTION_INPUTS = ("bias [(H+2KV)*D] or [1], cos, sin [N, D], k_cache, v_cache [KV*S, row] (kv_format.h), "
                     "write [N*KV] i32, table [R, NB] i32, pos [N] i32, rows [N] i32, meta [3] i32")

OPS: tuple[Op, ...] = (
    Op("matmul", "MindserveMatMul", "matmul(x [..., K], w) -> [..., N]",
       "x @ W; w from prepare_weight (float32 [1, K, N]), or GGUF blocks from prepare_qweight / prepare_qstack "
       "(uint8, dequantized on the fly inside the dot product: qmatmul.cc)",
       lambda _g, x, w: _matmul_shape(x, w)),
    Op("matmul_add", "MindserveMatMulAdd", "matmul_add(x, w, res [..., N]) -> [..., N]",
       "res + x @ W: a residual connection without a separate Add (the residual added once, after the product)",
       lambda _g, x, w, _r: _matmul_shape(x, w)),
    Op("matmul_add_lora", "MindserveMatMulAdd", "matmul_add(x, w, res, a, b, rows, segs) -> [..., N]",
       f"matmul_add plus each row's LoRA delta (multi-LoRA serving): {_LORA}",
       lambda _g, x, w, *_: _matmul_shape(x, w)),
    Op("qkv_attention", "MindserveQKVAttention",
       f"qkv_attention(qkv [N, (H+2KV)*D], {_ATTENTION_INPUTS} = (KV, block_size, has_bias), (qk_norm [2, D], "
       "qk_eps [1])) -> [N, H*D]",
       "a layer's attention after the qkv projection in one op: the bias, the split, (Qwen3's per-head q/k norms,) "
       "RoPE; this step's K/V rows written into the cache Parameters in place (row write[i*KV + h] gets head h of "
       "token i) before any key is read, so the graph has no ScatterUpdate; then causal attention straight out of "
       "the paged cache (attention.cc) for N tokens of any sequences (token i belongs to table row rows[i]), over "
       "each token's real keys 0..pos only. meta [5] adds (window, score scale bits): Gemma 3's sliding window",
       lambda g, qkv, *_: [qkv[0], g.heads * g.head_dim]),
    Op("norm_matmul", "MindserveNormMatMul", "norm_matmul(x, w_norm [C], eps [1], w) -> [..., N]",
       "matmul(rmsnorm(x, w_norm, eps), w) in one launch, the same bits as the two ops",
       lambda _g, x, _nw, _eps, w: _matmul_shape(x, w)),
    Op("norm_matmul_lora", "MindserveNormMatMul", "norm_matmul(x, w_norm, eps, w, a, b, rows, segs) -> [..., N]",
       "norm_matmul plus each row's LoRA delta", lambda _g, x, _nw, _eps, w, *_: _matmul_shape(x, w)),
    Op("swiglu_matmul_add", "MindserveSwiGLUMatMulAdd", "swiglu_matmul_add(gu [N, 2F], w, res [N, C]) -> [N, C]",
       "matmul_add(swiglu(gu), w, res) in one launch, the same bits as the two ops",
       lambda _g, _gu, _w, res: list(res)),
    Op("swiglu_matmul_add_lora", "MindserveSwiGLUMatMulAdd",
       "swiglu_matmul_add(gu, w, res, a, b, rows, segs) -> [N, C]", "swiglu_matmul_add plus each row's LoRA delta",
       lambda _g, _gu, _w, res, *_: list(res)),
    Op("decoder_layer", "MindserveDecoderLayer",
       "decoder_layer(x [N, C], attn_norm, eps, wqkv, bias, cos, sin, k_cache, v_cache, write, table, pos, rows, "
       "meta, wo, ffn_norm, w_gate_up, w_down, (qk_norm, qk_eps)) -> [N, C]",
       "a whole decoder layer without adapters in one op: norm_matmul, qkv_attention, matmul_add, norm_matmul, "
       "swiglu_matmul_add in order on scratch buffers, the same bits as those five ops",
       _same_as_first),
    Op("decoder_stack", "MindserveDecoderStack",
       "decoder_stack(x [N, C], write, table, pos, rows, smeta [3] i32 = (L, P, kind), layout [L*P, 6] i64, ropes "
       "(cos, sin, ...) [N, D]) -> [N, C]",
       "L decoder layers of one kind (0 decoder_layer, 1 gemma_decoder_layer, 2 moe_decoder_layer) as one op of few "
       "inputs: each layer's entry called in order on its P inputs, which the layout rows give as (address, ndim, "
       "dims, dtype) of the network's own Parameters or a rope input (the step's write/table/pos/rows shared), the "
       "rows passing through scratch buffers; the same bits as one op a layer (stack.cc)",
       _same_as_first),
    Op("embed_rope", "MindserveEmbedRope",
       "embed_rope(ids, pos (N elements, any shape) i32, embed [V, C], cos_t, sin_t [P, D]) -> (x [N, C], cos [N, D], "
       "sin [N, D])",
       "the embedding and rotary rows of every token: three gathers in one op",
       lambda _g, ids, _pos, embed, cos_t, _sin_t: _embed_rope_shapes(ids, embed, cos_t),
       lambda _i, _p, emb, *_: (emb, emb, emb)),
    Op("embed_rope_packed", "MindserveEmbedRopePacked",
       "embed_rope_packed(ids, pos i32, head [1, C/32*34, V] (a tied head's packed Q8_0 weight), cos_t, sin_t [P, D]) "
       "-> (x [N, C], cos [N, D], sin [N, D])",
       "embed_rope with the embedding rows dequantized from the tied LM head's packed Q8_0 blocks (vocab.cc): no "
       "float32 embedding table",
       lambda g, ids, _pos, head, cos_t, _sin_t: _embed_rope_shapes(ids, [0, head[1] // g.q8_packed * g.q8_block],
                                                                    cos_t),
       lambda _i, _p, _h, cos_t, *_: (cos_t, cos_t, cos_t)),
    Op("norm_head", "MindserveNormHead",
       "norm_head(x [N, C], w_norm, eps, last [R] i32, head) -> (logits [R, V], hidden [N, C])",
       "the final norm, the gather of the logit rows and the LM head in one op",
       lambda _g, x, _w, _e, last, head: ([last[0], head[-1]], list(x)), lambda x, *_: (x, x)),
    Op("rmsnorm", "MindserveRMSNorm", "rmsnorm(x [..., C], w [C], eps [1]) -> [..., C]",
       "x / sqrt(mean(x^2) + eps) * w", _same_as_first),
    Op("moe", "MindserveMoE",
       "moe(h [N, C], ffn_norm, eps, router, w_gate_up [E, ...], w_down [E, ...], meta [2] = (top_k, norm_topk)) "
       "-> [N, C]",
       "h + a routed-experts MLP (Qwen3-MoE): the norm, the router's softmax and top-k, then each expert some row "
       "chose on the block of those rows (each expert's slice is one matmul weight; the others are never read)",
       _same_as_first),
    Op("moe_decoder_layer", "MindserveMoEDecoderLayer",
       "moe_decoder_layer(<decoder_layer's inputs up to ffn_norm>, router, w_gate_up, w_down, moe_meta, (qk_norm, "
       "qk_eps)) -> [N, C]", "decoder_layer's attention half, then moe, as one op", _same_as_first),
    Op("gemma_decoder_layer", "MindserveGemmaDecoderLayer",
       "gemma_decoder_layer(x, attn_norm, eps, wqkv, bias, cos, sin, k_cache, v_cache, write, table, pos, rows, "
       "meta [5], wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm, qk_norm, qk_eps) -> [N, C]",
       "a Gemma 3 layer in one op: the sliding window and score scale in meta, the post-norms before each residual "
       "add, GeGLU", _same_as_first),
)


def _embed_rope_shapes(ids, embed, cos_t):
    n = 1
    for d in ids:
        n *= d
    return [n, embed[1]], [n, cos_t[1]], [n, cos_t[1]]


def manual() -> str:
    """The operators' manual: one paragraph per row of ``OPS``."""
    return "\n\n".join(f"{op.name} ({op.entry}): {op.call}\n    {op.does}." for op in OPS)


AotOps = make_dataclass("AotOps", [(op.name, Any) for op in OPS], frozen=True)
AotOps.__module__ = __name__
AotOps.__doc__ = ("The network's AOT operators, all from one library and one thread pool (kernels/ops.py's OPS):\n\n"
                  + manual())


def build_ops(custom: Callable[[str, Callable, Callable], Any], geometry: Geometry) -> Any:
    """An ``AotOps`` with each row's operator made by ``custom(entry, out_shape, out_dtype)``."""
    def shape_of(op: Op) -> Callable:
        return lambda *shapes: op.out_shape(geometry, *shapes)

    return AotOps(**{op.name: custom(op.entry, shape_of(op), op.out_dtype) for op in OPS})
