"""The Gemma 3 text network (``Gemma3ForCausalLM``) on both kernel paths, chosen with the runner as the Llama
family's networks are (``llama.py``: the same graph inputs, the same paged KV cache): ``AotGemma3`` (one
``gemma_decoder_layer`` op a layer) and ``StockGemma3`` (stock ops, subclassing the Llama stock layer's attention).

What differs from Llama: the embedding rows times sqrt(hidden_size) (float32, HF's ``embed_scale``); RMSNorms scaling
by (1 + weight) (``gemma3_weights`` adds the 1 once, in float32 as HF does); four norms a layer (the attention's and
the MLP's outputs are normalised before their residual adds); q/k head norms; GeGLU (gelu_pytorch_tanh); scores
scaled by query_pre_attn_scalar^-1/2; sliding-window layers (a query reads only the last ``sliding_window``
positions, itself included) with their own rope base, global layers with rope_theta and a linear scaling factor.
On the AOT path with a window pool (``engine/window_pool.py``: ``window_blocks``), the sliding-window layers keep
their K/V in caches of that many blocks, written and read through the pool's own table (two more inputs); without
one (and on stock ops) every layer keeps a full-length cache, the window applied when reading it. No adapter
slots (LoRA): the family declares none (``families/gemma3.py``), so they are refused before this is built.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from backends.mindspore.network.aot_layer import AotDecoderLayer
from backends.mindspore.network.common import DTYPES, RMSNorm, aot_weight, param, rope_tables, stock_weight
from backends.mindspore.network.embedding import aot_embedding
from backends.mindspore.network.llama import AotLMHead, StockLMHead, _Llama
from backends.mindspore.network.stack import Rope, layer_stack
from backends.mindspore.network.stock_layer import StockDecoderLayer
from backends.mindspore.modeldir.spec import ModelSpec

_NEG = -1e9  # the stock-op mask's "invisible" (runners/split.py)


def gemma3_weights(spec: ModelSpec, w: dict) -> dict:
    """The checkpoint's arrays with every norm weight replaced by 1 + weight (float32), under the names the Llama
    layers read: ``input_layernorm`` the attention's input norm, ``post_attention_layernorm`` the MLP's input norm
    (Gemma's ``pre_feedforward_layernorm``); Gemma's own two post-norms as ``gemma.post_attention_norm`` /
    ``gemma.post_ffn_norm``."""
    from backends.mindspore.modeldir.weights import WeightsError

    def plus_one(name: str) -> np.ndarray:
        if name not in w:
            raise WeightsError(f"{spec.checkpoint}: {spec.arch} needs {name}, which the checkpoint lacks")
        return (np.asarray(w[name], np.float32) + np.float32(1)).astype(np.float32)

    out = dict(w)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = plus_one(p + "input_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = plus_one(p + "pre_feedforward_layernorm.weight")
        out[p + "gemma.post_attention_norm"] = plus_one(p + "post_attention_layernorm.weight")
        out[p + "gemma.post_ffn_norm"] = plus_one(p + "post_feedforward_layernorm.weight")
        for n in "qk":
            out[p + f"self_attn.{n}_norm.weight"] = plus_one(p + f"self_attn.{n}_norm.weight")
    out["model.norm.weight"] = plus_one("model.norm.weight")
    return out


def gemma3_rope(spec: ModelSpec, max_positions: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """((cos, sin) of the global layers, (cos, sin) of the local layers), [max_positions, head_dim] each: the global
    ones at positions / rope_scaling_factor (HF's linear rope type divides the frequencies by the factor)."""
    g = spec.gemma3
    cos, sin = rope_tables(spec.head_dim, max_positions, spec.rope_theta)
    if g.rope_scaling_factor != 1.0:
        inv = 1.0 / (spec.rope_theta ** (np.arange(0, spec.head_dim, 2, dtype=np.float64) / spec.head_dim))
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv / g.rope_scaling_factor)
        angles = np.concatenate([angles, angles], axis=-1)
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return (cos, sin), rope_tables(spec.head_dim, max_positions, g.rope_local_theta)


def attention_meta(spec: ModelSpec, block_size: int, local: bool) -> np.ndarray:
    """QKVAttention's meta [5]: (KV, block size, has_bias, the window (0 on a global layer), the scale's float32
    bits)."""
    scale = np.array([spec.gemma3.attn_scale], np.float32).view(np.int32)[0]
    window = spec.gemma3.sliding_window if local else 0
    return np.array([spec.num_kv_heads, block_size, int(spec.qkv_has_bias), window, scale], np.int32)


class AotGemma3Layer(AotDecoderLayer):
    """``AotDecoderLayer``'s weights and cache plus the two post-norms; one ``gemma_decoder_layer`` op. ``rope`` is
    0 (global tables) or 1 (local); a ``pooled`` layer writes and reads through the window pool's rows and table."""

    def __init__(self, spec: ModelSpec, w: dict, i: int, num_slots: int, block_size: int, aot,
                 kv_dtype: str = "float32", pooled: bool = False) -> None:
        super().__init__(spec, w, i, num_slots, block_size, aot, kv_dtype)
        p, local = f"model.layers.{i}.", spec.gemma3.sliding_layers[i]
        self.pooled = pooled  # its cache is the window pool's (num_slots of it)
        self.attn_meta = Tensor(attention_meta(spec, block_size, local))
        self.post_attn_norm = param(w[p + "gemma.post_attention_norm"], p + "post_attn_norm")
        self.post_ffn_norm = param(w[p + "gemma.post_ffn_norm"], p + "post_ffn_norm")
        self.rope = int(local)

    stack_kind = 1  # decoder_stack's gemma_decoder_layer (a pooled layer's write and table are its own: not stacked)

    def stack_inputs(self, cos, sin) -> tuple:
        """``AotDecoderLayer.stack_inputs`` of this layer's op; ``cos``/``sin`` the rows of its rope."""
        return (self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv, cos, sin, self.k_cache,
                self.v_cache, self.attn_meta, self.wo, self.post_attn_norm, self.ffn_norm.weight, self.w_gate_up,
                self.w_down, self.post_ffn_norm, self.qk_norm, self.qk_norm_eps)

    def construct(self, x, rope, pos, write_idx, table, token_rows, window_write=None, window_table=None):
        cos, sin = rope[self.rope]
        if self.pooled:  # a sliding-window layer whose cache is the window pool's: its rows, its table
            write_idx, table = window_write, window_table
        return self.aot.gemma_decoder_layer(x, self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv, cos,
                                            sin, self.k_cache, self.v_cache, write_idx, table, pos, token_rows,
                                            self.attn_meta, self.wo, self.post_attn_norm, self.ffn_norm.weight,
                                            self.w_gate_up, self.w_down, self.post_ffn_norm, self.qk_norm,
                                            self.qk_norm_eps)


class AotGemma3(_Llama):
    """``AotLlama``'s inputs and outputs (llama.py): the embedding and the global rotary rows in one op, the local
    rotary rows gathered, the scaled rows through one op a layer, then the final norm and the tied head."""

    def __init__(self, spec: ModelSpec, w: dict, num_blocks: int, block_size: int, max_positions: int, aot,
                 lora: tuple[int, int] | None = None, kv_dtype: str = "float32", window_blocks: int = 0) -> None:
        super().__init__(None)
        w = gemma3_weights(spec, w)
        self.aot = aot
        # per layer: whether it reads the window pool (its inputs after last_rows) instead of the full-length one
        pooled = [bool(window_blocks) and local for local in spec.gemma3.sliding_layers]
        head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
        self.head = aot_weight([head], "lm_head")
        self.embedding = aot_embedding(spec, w, self.head, aot)  # rows of the head's own blocks when tied Q8_0
        self.embed_scale = Tensor(np.float32(np.sqrt(spec.hidden_size)), ms.float32)
        (cos_g, sin_g), (cos_l, sin_l) = gemma3_rope(spec, max_positions)
        self.cos, self.sin = param(cos_g, "rope_cos"), param(sin_g, "rope_sin")
        self.cos_local, self.sin_local = param(cos_l, "rope_cos_local"), param(sin_l, "rope_sin_local")
        slots = num_blocks * block_size
        self.layers = nn.CellList([AotGemma3Layer(spec, w, i, window_blocks * block_size if pooled[i] else slots,
                                                  block_size, aot, kv_dtype, pooled[i])
                                   for i in range(spec.num_layers)])
        self.norm_w = param(w["model.norm.weight"], "norm")
        self.eps_t = Tensor(np.array([spec.rms_norm_eps], np.float32))
        # a pooled layer's write rows and table are the pool's: one op a layer then
        ropes = lambda layer: (Rope(2 * layer.rope), Rope(2 * layer.rope + 1))  # noqa: E731 (its global or local pair)
        self.use_stack(None if any(pooled) else layer_stack(self.layers, ropes))

    def lm_head(self) -> nn.Cell:
        return AotLMHead(self.head, self.aot)

    def construct(self, ids, pos, write_idx, table, token_rows, last_rows, window_write=None, window_table=None):
        x, cos, sin = self.embedding(ids, pos, self.cos, self.sin)  # [N, dim], [N, hd], [N, hd]
        flat = ops.reshape(pos, (-1,))
        rope = ((cos, sin), (ops.gather(self.cos_local, flat, 0), ops.gather(self.sin_local, flat, 0)))
        x = x * self.embed_scale
        if self.stack_meta is not None:
            x = self.aot.decoder_stack(x, write_idx, table, pos, token_rows, self.stack_meta, self.stack_layout,
                                       *rope[0], *rope[1])
        else:
            for layer in self.layers:
                x = layer(x, rope, pos, write_idx, table, token_rows, window_write, window_table)
        return self.aot.norm_head(x, self.norm_w, self.eps_t, last_rows, self.head)


class StockGemma3Layer(StockDecoderLayer):
    """``StockDecoderLayer``'s attention (its scale set to query_pre_attn_scalar^-1/2) and weights, Gemma's layer
    order: out = h + post_ffn_norm(mlp(ffn_norm(h))), h = x + post_attn_norm(attention(attn_norm(x))); GeGLU.
    ``rope`` / ``mask`` pick the global (0) or local (1) rotary rows and mask."""

    def __init__(self, spec: ModelSpec, w: dict, i: int, num_slots: int, dtype=ms.float32) -> None:
        super().__init__(spec, w, i, num_slots, dtype, None)
        p = f"model.layers.{i}."
        self.scale = spec.gemma3.attn_scale
        self.post_attn_norm = RMSNorm(w[p + "gemma.post_attention_norm"], spec.rms_norm_eps, p + "post_attn_norm",
                                      dtype)
        self.post_ffn_norm = RMSNorm(w[p + "gemma.post_ffn_norm"], spec.rms_norm_eps, p + "post_ffn_norm", dtype)
        self.rope = int(spec.gemma3.sliding_layers[i])

    def construct(self, x, rope, pos, write_idx, read_rows, masks, lora=None):
        b, t, dim = x.shape
        cos, sin = rope[self.rope]
        heads = self._attention(self.attn_norm(x), cos, sin, write_idx, read_rows, masks[self.rope], None)
        x = x + ops.reshape(self.post_attn_norm(ops.matmul(heads, self.wo)), (b, t, dim))
        normed = ops.reshape(self.ffn_norm(x), (b * t, dim))
        gate_up = ops.matmul(normed, self.w_gate_up)
        act = ops.gelu(gate_up[:, : self.ffn], approximate="tanh") * gate_up[:, self.ffn:]
        return x + ops.reshape(self.post_ffn_norm(ops.matmul(act, self.w_down)), (b, t, dim))


class StockGemma3(_Llama):
    """``StockLlama``'s inputs and outputs (llama.py); the local layers' mask is the runner's with the keys at or
    before pos - sliding_window hidden too (key j of a row's window is position j)."""

    def __init__(self, spec: ModelSpec, w: dict, num_blocks: int, block_size: int, max_positions: int,
                 dtype: str = "float32", lora: tuple[int, int] | None = None) -> None:
        super().__init__(None)
        w = gemma3_weights(spec, w)
        self.dim = spec.hidden_size
        self.dtype = dt = DTYPES[dtype]
        self.low_precision = dt != ms.float32
        self.embed = param(w["model.embed_tokens.weight"], "embed", dt)
        self.embed_scale = Tensor(np.float32(np.sqrt(spec.hidden_size)), dt)
        head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
        self.head = stock_weight([head], "lm_head", dt)
        (cos_g, sin_g), (cos_l, sin_l) = gemma3_rope(spec, max_positions)
        self.cos, self.sin = param(cos_g, "rope_cos", dt), param(sin_g, "rope_sin", dt)
        self.cos_local, self.sin_local = param(cos_l, "rope_cos_local", dt), param(sin_l, "rope_sin_local", dt)
        self.window = spec.gemma3.sliding_window
        self.key_pos = Tensor(np.arange(max_positions, dtype=np.int32))
        self.layers = nn.CellList([StockGemma3Layer(spec, w, i, num_blocks * block_size, dt)
                                   for i in range(spec.num_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], spec.rms_norm_eps, "norm", dt)

    def lm_head(self) -> nn.Cell:
        return StockLMHead(self.head, self.dtype)

    def _rows(self, table, pos):
        return ops.expand_dims(ops.gather(table, pos, 0), 2)  # [B, T, 1, hd]

    def construct(self, ids, pos, write_idx, read_rows, mask, last_rows, lora=None):
        b, t = ids.shape
        x = ops.gather(self.embed, ids, 0) * self.embed_scale  # [B, T, D]
        rope = ((self._rows(self.cos, pos), self._rows(self.sin, pos)),
                (self._rows(self.cos_local, pos), self._rows(self.sin_local, pos)))
        w = mask.shape[-1]
        far = ops.less_equal(ops.reshape(self.key_pos[:w], (1, 1, w)), ops.expand_dims(pos - self.window, 2))
        local = mask + ops.expand_dims(ops.cast(far, ms.float32) * _NEG, 1)  # [B, 1, T, W]
        if self.low_precision:
            mask, local = ops.cast(mask, self.dtype), ops.cast(local, self.dtype)
        for layer in self.layers:
            x = layer(x, rope, pos, write_idx, read_rows, (mask, local))
        hidden = self.norm(ops.reshape(x, (b * t, self.dim)))
        logits = ops.matmul(ops.gather(hidden, last_rows, 0), self.head)  # [B, V]
        if self.low_precision:
            return ops.cast(logits, ms.float32), ops.cast(hidden, ms.float32)
        return logits, hidden
