"""The AOT-kernel decoder layers (``backends.mindspore.kernels``): rows flat [N, dim] (N = B*T), the
paged attention kernel reading each token's keys through the block table.

``AotDecoderLayer`` is one op (``decoder_layer``). ``AotLoraDecoderLayer``, for a network with adapter
slots, is the same five kernels as five ops with each row's adapter applied: norm + qkv matmul, attention
(bias, Qwen3's q/k head norms, split + rotary, the in-place cache writes and paged attention in one kernel),
o matmul + residual, norm + gate/up matmul, SwiGLU + down matmul + residual (the one op runs those five kernels
in that order: the same bits).
"""
from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn

from backends.mindspore.network.common import (AotRMSNorm, aot_weight, head_norm_weights, kv_cache_param,
                                               lora_factors, param)
from backends.mindspore.modeldir.spec import ModelSpec


class AotDecoderLayer(nn.Cell):
    """Attention + MLP for one layer; owns the layer's K/V cache ``[kv_heads * num_slots, head_dim]``.

    Inputs: x [N, dim] before the attention norm; cos/sin [N, D]; pos [N] or [B, T]; write_idx [N*kv];
    table [R, NB] the block table; token_rows [N] each token's table row. Same shape out."""

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], i: int, num_slots: int, block_size: int,
                 aot, kv_dtype: str = "float32") -> None:
        super().__init__()
        p = f"model.layers.{i}."
        self.aot = aot
        self.attn_meta = Tensor(np.array([spec.num_kv_heads, block_size, int(spec.qkv_has_bias)], np.int32))
        q, k, v = (w[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        self.wqkv = aot_weight([q, k, v], p + "wqkv")  # q, k, v rows stacked, in the kernel's layout
        if spec.qkv_has_bias:
            self.bqkv = param(np.concatenate([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]), p + "bqkv")
        else:  # the attention kernel's bias input, never read (attn_meta says there is none)
            self.bqkv = Tensor(np.zeros(1, np.float32))
        self.wo = aot_weight([w[p + "self_attn.o_proj.weight"]], p + "wo")
        self._init_mlp(spec, w, p)
        self.attn_norm = AotRMSNorm(w[p + "input_layernorm.weight"], spec.rms_norm_eps, p + "attn_norm", aot)
        self.ffn_norm = AotRMSNorm(w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps, p + "ffn_norm", aot)
        # Row kv_head * num_slots + slot holds one head's K (or V) of one token, in kv_dtype; the attention
        # kernel writes this step's rows itself, through the Parameter's own memory, before any key is read.
        rows = spec.num_kv_heads * num_slots
        self.k_cache = kv_cache_param(kv_dtype, rows, spec.head_dim, p + "k_cache")
        self.v_cache = kv_cache_param(kv_dtype, rows, spec.head_dim, p + "v_cache")
        # The attention kernel's optional trailing inputs: Qwen3's q/k head norms [2, D] and their eps, or none.
        # Attributes of their own, so the Cell registers them: Parameters held only in a tuple are not among the
        # network's parameters, and MindSpore's compile cache then reloads the graphs without them (measured: a
        # Qwen3 server restarted on its cached graphs gave other ids).
        norms = head_norm_weights(spec, w, p)
        self.has_head_norm = norms is not None
        if self.has_head_norm:
            self.qk_norm = param(norms, p + "qk_norm")
            self.qk_norm_eps = param(np.array([spec.rms_norm_eps]), p + "qk_norm_eps")

    # decoder_stack's kind for this class's op (kernels/stack.cc): 0 decoder_layer; None: not stackable
    stack_kind: int | None = 0

    def stack_inputs(self, cos, sin) -> tuple:
        """This layer's group of ``decoder_stack`` inputs: its op's inputs but x and the step's write, table, pos
        and rows, in the op's order."""
        group = (self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv, cos, sin, self.k_cache,
                 self.v_cache, self.attn_meta, self.wo, self.ffn_norm.weight, self.w_gate_up, self.w_down)
        if self.has_head_norm:
            return group + (self.qk_norm, self.qk_norm_eps)
        return group

    def _init_mlp(self, spec: ModelSpec, w: dict[str, np.ndarray], p: str) -> None:
        self.w_gate_up = aot_weight([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], p + "w_gate_up")
        self.w_down = aot_weight([w[p + "mlp.down_proj.weight"]], p + "w_down")

    def construct(self, x, cos, sin, pos, write_idx, table, token_rows, lora=None):
        if self.has_head_norm:
            return self.aot.decoder_layer(x, self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv, cos,
                                          sin, self.k_cache, self.v_cache, write_idx, table, pos, token_rows,
                                          self.attn_meta, self.wo, self.ffn_norm.weight, self.w_gate_up, self.w_down,
                                          self.qk_norm, self.qk_norm_eps)
        return self.aot.decoder_layer(x, self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv, cos, sin,
                                      self.k_cache, self.v_cache, write_idx, table, pos, token_rows, self.attn_meta,
                                      self.wo, self.ffn_norm.weight, self.w_gate_up, self.w_down)


class AotLoraDecoderLayer(AotDecoderLayer):
    """``AotDecoderLayer`` with adapter slots: ``lora`` [N] is each token's slot (-1: none, an exact zero)."""

    stack_kind = None  # five ops a layer, each row's adapter applied

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], i: int, num_slots: int, block_size: int, aot,
                 slots: int, rank: int, kv_dtype: str = "float32") -> None:
        super().__init__(spec, w, i, num_slots, block_size, aot, kv_dtype)
        from backends.lora import BaseDims
        from backends.mindspore.network.lora_groups import GROUPS, group_segments

        p, dims = f"model.layers.{i}.", BaseDims.of(spec)
        for group in GROUPS:
            a, b = lora_factors(spec, p, group, slots, rank)
            setattr(self, f"lora_{group}_a", a)
            setattr(self, f"lora_{group}_b", b)
            setattr(self, f"lora_{group}_segs", Tensor(np.array(group_segments(dims, group), np.int32)))

    def adapter_factors(self, group: str):
        """The Parameters (a, b) ``ModelRunner.write_lora`` writes one group's slots into."""
        return getattr(self, f"lora_{group}_a"), getattr(self, f"lora_{group}_b")

    def construct(self, x, cos, sin, pos, write_idx, table, token_rows, lora=None):
        qkv = self.aot.norm_matmul_lora(x, self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.lora_qkv_a,
                                        self.lora_qkv_b, lora, self.lora_qkv_segs)
        # One kernel: bias, RoPE, this step's K/V rows written into the cache Parameters (their memory, in
        # place, before any key is read), then paged attention over them. Nothing else in the graph reads or
        # writes the caches, so no ordering between ops is involved; the next step's graph runs after
        # this one has returned its outputs.
        if self.has_head_norm:
            attn = self.aot.qkv_attention(qkv, self.bqkv, cos, sin, self.k_cache, self.v_cache, write_idx, table, pos,
                                          token_rows, self.attn_meta, self.qk_norm, self.qk_norm_eps)
        else:
            attn = self.aot.qkv_attention(qkv, self.bqkv, cos, sin, self.k_cache, self.v_cache, write_idx, table, pos,
                                          token_rows, self.attn_meta)
        x = self.aot.matmul_add_lora(attn, self.wo, x, self.lora_o_a, self.lora_o_b, lora, self.lora_o_segs)
        gate_up = self.aot.norm_matmul_lora(x, self.ffn_norm.weight, self.ffn_norm.eps_t, self.w_gate_up,
                                            self.lora_gate_up_a, self.lora_gate_up_b, lora, self.lora_gate_up_segs)
        return self.aot.swiglu_matmul_add_lora(gate_up, self.w_down, x, self.lora_down_a, self.lora_down_b, lora,
                                               self.lora_down_segs)
