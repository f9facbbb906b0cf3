"""The stock-op decoder layer: the same maths as the AOT layers in stock MindSpore ops, in the yaml's
compute dtype, attending over a gathered window of the cache under an additive mask. Adapter slots are a
delta cell per projection group (``SlotDelta``, or ``NoDelta`` without adapter slots)."""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from backends.mindspore.network.common import (RMSNorm, head_norm_weights, lora_factors, param, stock_weight,
                                              zeros_param)
from backends.mindspore.modeldir.spec import ModelSpec


class NoDelta(nn.Cell):
    """A network without adapter slots: the product as it is."""

    def construct(self, x, y, rows=None):
        return y


class NoNorm(nn.Cell):
    """A model without q/k head norms: the heads as they are."""

    def construct(self, x):
        return x


class SlotDelta(nn.Cell):
    """Each row's LoRA delta [N, out] added to y for x [N, K], its slot in rows [N] (-1: none, an exact zero).
    Every slot's shrink in one product, masked to the row's own slot, then one expand whose rows are each
    slot's b restricted to its projection's columns (``cols`` [G, N])."""

    def __init__(self, spec: ModelSpec, p: str, group: str, slots: int, rank: int, dtype) -> None:
        super().__init__()
        from backends.lora import BaseDims
        from backends.mindspore.network.lora_groups import group_segments

        self.a, self.b = lora_factors(spec, p, group, slots, rank, dtype)
        segs = group_segments(BaseDims.of(spec), group)
        cols = np.zeros((len(segs) - 1, segs[-1]), np.float32)
        for g in range(len(segs) - 1):
            cols[g, segs[g]:segs[g + 1]] = 1
        self.cols = Tensor(cols, dtype)
        self.slot_ids = Tensor(np.arange(slots, dtype=np.int32))

    def construct(self, x, y, rows=None):
        a, b = self.a, self.b
        n = x.shape[0]
        s, k, gr = a.shape
        t = ops.matmul(x, ops.reshape(ops.transpose(a, (1, 0, 2)), (k, s * gr)))  # [N, S*GR]
        own = ops.cast(ops.equal(ops.expand_dims(rows, 1), ops.expand_dims(self.slot_ids, 0)), x.dtype)
        t = ops.reshape(ops.reshape(t, (n, s, gr)) * ops.expand_dims(own, 2), (n, s * gr))
        expand = ops.expand_dims(b, 1) * ops.expand_dims(ops.expand_dims(self.cols, 0), 2)  # [S, G, R, N]
        return y + ops.matmul(t, ops.reshape(expand, (s * gr, -1)))


class StockDecoderLayer(nn.Cell):
    """Attention + MLP for one layer; owns the layer's K/V cache ``[kv_heads * num_slots, head_dim]``.

    Inputs: x [B, T, dim]; cos/sin [B, T, 1, D]; write_idx [B*T*kv]; read_rows [kv, B, W]; mask
    [B, 1, T, W]; lora [B*T] each token's adapter slot (with adapter slots). Same shape out."""

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], i: int, num_slots: int, dtype=ms.float32,
                 lora: tuple[int, int] | None = None) -> None:
        super().__init__()
        p = f"model.layers.{i}."
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q, k, v = (w[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        self.wqkv = stock_weight([q, k, v], p + "wqkv", dtype)  # q, k, v rows stacked, [in, out]
        self.has_bias = spec.qkv_has_bias
        if self.has_bias:
            self.bqkv = param(np.concatenate([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]), p + "bqkv", dtype)
        self.wo = stock_weight([w[p + "self_attn.o_proj.weight"]], p + "wo", dtype)
        self._init_mlp(spec, w, p, dtype)
        self.attn_norm = RMSNorm(w[p + "input_layernorm.weight"], spec.rms_norm_eps, p + "attn_norm", dtype)
        self.ffn_norm = RMSNorm(w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps, p + "ffn_norm", dtype)
        # Row kv_head * num_slots + slot holds one head's K (or V) of one token. 2-D, so ScatterUpdate
        # writes it in place (ScatterNdUpdate, or any reshape of the Parameter, copies the whole cache);
        # kv-head-major, so a gather of rows is already the [kv, B, W, D] the attention multiplies.
        cache_shape = (spec.num_kv_heads * num_slots, spec.head_dim)
        self.k_cache = zeros_param(cache_shape, dtype, p + "k_cache")
        self.v_cache = zeros_param(cache_shape, dtype, p + "v_cache")
        self.scatter = ops.ScatterUpdate()
        self.bmm = ops.BatchMatMul()
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.scale = 1.0 / float(np.sqrt(spec.head_dim))
        norms = head_norm_weights(spec, w, p)  # Qwen3: RMSNorm over each q / k head before RoPE
        if norms is None:
            self.q_norm, self.k_norm = NoNorm(), NoNorm()
        else:
            self.q_norm = RMSNorm(norms[0], spec.rms_norm_eps, p + "q_norm", dtype)
            self.k_norm = RMSNorm(norms[1], spec.rms_norm_eps, p + "k_norm", dtype)
        for group in ("qkv", "o", "gate_up", "down"):
            setattr(self, f"{group}_delta", NoDelta() if lora is None else SlotDelta(spec, p, group, *lora, dtype))

    def _init_mlp(self, spec: ModelSpec, w: dict[str, np.ndarray], p: str, dtype) -> None:
        self.w_gate_up = stock_weight([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], p + "w_gate_up",
                                      dtype)
        self.w_down = stock_weight([w[p + "mlp.down_proj.weight"]], p + "w_down", dtype)
        self.ffn = spec.intermediate_size

    def adapter_factors(self, group: str):
        """The Parameters (a, b) ``ModelRunner.write_lora`` writes one group's slots into."""
        delta = getattr(self, f"{group}_delta")
        return delta.a, delta.b

    def _mlp(self, normed, lora):
        """The MLP of normed rows [N, dim] (residual not added)."""
        gate_up = self.gate_up_delta(normed, ops.matmul(normed, self.w_gate_up), lora)
        act = ops.silu(gate_up[:, : self.ffn]) * gate_up[:, self.ffn:]
        return self.down_delta(act, ops.matmul(act, self.w_down), lora)

    def _rope(self, x, cos, sin):
        # x: [B, T, heads, D]; cos/sin: [B, T, 1, D]
        half = self.head_dim // 2
        rotated = ops.concat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rotated * sin

    def _attention(self, x, cos, sin, write_idx, read_rows, mask, lora):
        """x [B, T, dim]; cos/sin [B, T, 1, D]; read_rows [kv, B, W]; mask [B, 1, T, W]; lora [B*T]."""
        b, t, _ = x.shape
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        g = h // kvh
        flat = ops.reshape(x, (b * t, -1))
        qkv = self.qkv_delta(flat, ops.matmul(flat, self.wqkv), lora)
        if self.has_bias:
            qkv = qkv + self.bqkv
        q = ops.reshape(qkv[:, : h * d], (b, t, h, d))
        k = ops.reshape(qkv[:, h * d: (h + kvh) * d], (b, t, kvh, d))
        v = ops.reshape(qkv[:, (h + kvh) * d:], (b * t * kvh, d))
        q = self._rope(self.q_norm(q), cos, sin)
        k = ops.reshape(self._rope(self.k_norm(k), cos, sin), (b * t * kvh, d))
        keys = ops.gather(self.scatter(self.k_cache, write_idx, k), read_rows, 0)  # [kv, B, W, D]
        values = ops.gather(self.scatter(self.v_cache, write_idx, v), read_rows, 0)
        # GQA without repeating K/V: group query heads under their kv head. q: [kv, B, G*T, D]
        q = ops.transpose(ops.reshape(q, (b, t, kvh, g, d)), (2, 0, 3, 1, 4))
        q = ops.reshape(q, (kvh, b, g * t, d))
        scores = self.bmm_t(q, keys) * self.scale  # [kv, B, G*T, W]
        scores = ops.reshape(scores, (kvh, b, g, t, -1)) + mask
        probs = ops.reshape(ops.softmax(scores, -1), (kvh, b, g * t, -1))
        out = self.bmm(probs, values)  # [kv, B, G*T, D]
        out = ops.transpose(ops.reshape(out, (kvh, b, g, t, d)), (1, 3, 0, 2, 4))
        return ops.reshape(out, (b * t, h * d))

    def construct(self, x, cos, sin, pos, write_idx, read_rows, mask, lora=None):
        b, t, dim = x.shape
        heads = self._attention(self.attn_norm(x), cos, sin, write_idx, read_rows, mask, lora)
        x = x + ops.reshape(self.o_delta(heads, ops.matmul(heads, self.wo), lora), (b, t, dim))
        normed = ops.reshape(self.ffn_norm(x), (b * t, dim))
        return x + ops.reshape(self._mlp(normed, lora), (b, t, dim))


