"""Qwen3-MoE's layers with routed experts on both kernel paths, and its networks: ``AotMoeLlama`` / ``StockMoeLlama``
are ``network/llama.py``'s with an expert layer wherever ``spec.moe`` names one (the other layers keep a dense MLP).
No adapter slots: the family declares none (refused before this is built)."""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from backends.mindspore.modeldir.spec import ModelSpec
from backends.mindspore.network.aot_layer import AotDecoderLayer
from backends.mindspore.network.common import aot_experts, aot_weight, stock_experts, stock_weight
from backends.mindspore.network.llama import AotLlama, StockLlama
from backends.mindspore.network.stock_layer import StockDecoderLayer


class AotMoeDecoderLayer(AotDecoderLayer):
    """A layer with routed experts (Qwen3-MoE) in one op (``moe_decoder_layer``): the attention half of
    ``AotDecoderLayer``, then the router and the experts each token chose (moe.cc). The experts' gate/up and down
    matrices are stacked [E, ...], each expert's slice one matmul weight (GGUF blocks stay blocks)."""

    def _init_mlp(self, spec: ModelSpec, w: dict[str, np.ndarray], p: str) -> None:
        moe = spec.moe
        self.router = aot_weight([w[p + "mlp.gate.weight"]], p + "router")
        q = p + "mlp.experts.{}."
        self.w_gate_up = aot_experts([[w[q.format(e) + "gate_proj.weight"], w[q.format(e) + "up_proj.weight"]]
                                      for e in range(moe.num_experts)], p + "experts_gate_up")
        self.w_down = aot_experts([[w[q.format(e) + "down_proj.weight"]] for e in range(moe.num_experts)],
                                  p + "experts_down")
        self.moe_meta = Tensor(np.array([moe.top_k, int(moe.norm_topk_prob)], np.int32))

    stack_kind = 2  # decoder_stack's moe_decoder_layer

    def stack_inputs(self, cos, sin) -> tuple:
        group = (self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv, cos, sin, self.k_cache,
                 self.v_cache, self.attn_meta, self.wo, self.ffn_norm.weight, self.router, self.w_gate_up,
                 self.w_down, self.moe_meta)
        if self.has_head_norm:
            return group + (self.qk_norm, self.qk_norm_eps)
        return group

    def construct(self, x, cos, sin, pos, write_idx, table, token_rows, lora=None):
        if self.has_head_norm:
            return self.aot.moe_decoder_layer(x, self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv,
                                              cos, sin, self.k_cache, self.v_cache, write_idx, table, pos, token_rows,
                                              self.attn_meta, self.wo, self.ffn_norm.weight, self.router,
                                              self.w_gate_up, self.w_down, self.moe_meta, self.qk_norm,
                                              self.qk_norm_eps)
        return self.aot.moe_decoder_layer(x, self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv, cos,
                                          sin, self.k_cache, self.v_cache, write_idx, table, pos, token_rows,
                                          self.attn_meta, self.wo, self.ffn_norm.weight, self.router, self.w_gate_up,
                                          self.w_down, self.moe_meta)


class StockMoeDecoderLayer(StockDecoderLayer):
    """A layer with routed experts (Qwen3-MoE), in stock ops and exactly: the router's logits and softmax in
    float32 (as HF routes), the top-k (renormalised when the model says so) spread into a dense [N, E] weight
    matrix with zeros for the experts a row did not choose, then every expert on every row as one batched matmul
    and the weighted sum. Correct, not sparse: the AOT path (moe.cc) reads only the chosen experts."""

    def _init_mlp(self, spec: ModelSpec, w: dict[str, np.ndarray], p: str, dtype) -> None:
        moe = spec.moe
        self.num_experts, self.top_k, self.norm_topk = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.ffn, self.dtype = moe.intermediate_size, dtype
        self.router = stock_weight([w[p + "mlp.gate.weight"]], p + "router")  # [dim, E] float32
        q = p + "mlp.experts.{}."
        self.w_gate_up = stock_experts([[w[q.format(e) + "gate_proj.weight"], w[q.format(e) + "up_proj.weight"]]
                                        for e in range(moe.num_experts)], p + "experts_gate_up", dtype)
        self.w_down = stock_experts([[w[q.format(e) + "down_proj.weight"]] for e in range(moe.num_experts)],
                                    p + "experts_down", dtype)
        self.expert_ids = Tensor(np.arange(moe.num_experts, dtype=np.int32))

    def _mlp(self, normed, lora):
        n, dim = normed.shape
        e = self.num_experts
        logits = ops.matmul(ops.cast(normed, ms.float32), self.router)  # [N, E]
        top, idx = ops.topk(ops.softmax(logits, -1), self.top_k)  # [N, k], probabilities in rank order
        if self.norm_topk:
            top = top / ops.sum(top, -1, keepdim=True)
        chosen = ops.cast(ops.equal(ops.expand_dims(idx, 2), self.expert_ids), ms.float32)  # [N, k, E]
        weight = ops.sum(chosen * ops.expand_dims(top, 2), 1)  # [N, E], 0 where not chosen
        x = ops.broadcast_to(ops.expand_dims(normed, 0), (e, n, dim))
        gate_up = self.bmm(x, self.w_gate_up)  # [E, N, 2F]
        act = ops.silu(gate_up[..., : self.ffn]) * gate_up[..., self.ffn:]
        down = self.bmm(act, self.w_down)  # [E, N, dim]
        weight = ops.cast(ops.expand_dims(ops.transpose(weight, (1, 0)), 2), down.dtype)  # [E, N, 1]
        return ops.sum(down * weight, 0)


class AotMoeLlama(AotLlama):
    """``AotLlama`` with routed experts (Qwen3-MoE) in the layers ``spec.moe`` names; no adapter slots (its family
    declares none: refused before this is built)."""

    @staticmethod
    def layer(spec: ModelSpec, w: dict, i: int, slots: int, block_size: int, aot, lora, kv_dtype: str) -> nn.Cell:
        if i in spec.moe.sparse_layers:
            return AotMoeDecoderLayer(spec, w, i, slots, block_size, aot, kv_dtype)
        return AotDecoderLayer(spec, w, i, slots, block_size, aot, kv_dtype)


class StockMoeLlama(StockLlama):
    """``StockLlama`` with routed experts in the layers ``spec.moe`` names."""

    @staticmethod
    def layer(spec: ModelSpec, w: dict, i: int, slots: int, dtype, lora) -> nn.Cell:
        return (StockMoeDecoderLayer if i in spec.moe.sparse_layers else StockDecoderLayer)(spec, w, i, slots, dtype,
                                                                                            None)
