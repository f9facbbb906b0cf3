"""The Llama-shaped network (Llama 2/3, Qwen2, Qwen3, Mistral, SmolLM2) with a
paged KV cache, in MindSpore GRAPH mode, in two strategies chosen with the runner: ``AotLlama`` on the AOT kernels
(``PackedRunner``) and ``StockLlama`` on stock ops (``SplitRunner``); Qwen3-MoE's subclass them with its expert
layers (``families/qwen3_moe/network.py``).

One ``construct`` serves prefill chunks and decode steps: tokens are written into the cache first, then
attend through it, so the graph depends only on the shapes (batch, tokens, and, for the stock-op path, the
attention window). Inputs: ids, pos [B, T] int32; write_idx [B*T*kv] int32 (cache row
``head * num_slots + slot`` of each new K/V head row, token-major; padding -> scratch slot 0); the
strategy's attention inputs (below); last_rows [R] int32 (flat rows in B*T whose logits to return); with
adapter slots, lora [B*T] int32 each token's slot (-1: none). Out: logits [R, V] and the final-normed
hidden rows [B*T, D], float32.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import nn, ops

from backends.mindspore.network.aot_layer import AotDecoderLayer, AotLoraDecoderLayer
from backends.mindspore.network.common import (DTYPES, AotRMSNorm, RMSNorm, aot_weight, param, rope_tables,
                                               stock_weight)
from backends.mindspore.network.embedding import aot_embedding
from backends.mindspore.network.stack import LayerStack, layer_stack
from backends.mindspore.network.stock_layer import StockDecoderLayer
from backends.mindspore.modeldir.spec import ModelSpec


class _Llama(nn.Cell):
    """What both strategies' inputs end with: with adapter slots, each token's slot (read by the adapter layers
    only). A network without them takes no such input: passed unused, it cost 3-4 ms a decode step (MindSpore 2.9)."""

    def __init__(self, lora: tuple[int, int] | None) -> None:
        super().__init__()
        self.adapter_slots = lora  # (slots, rank) in every layer, or None

    def use_stack(self, stack: LayerStack | None) -> None:
        """The decoder layers as one op (``stack``: network/stack.py), or one op a layer (None)."""
        self.stack_meta = None if stack is None else stack.meta
        self.stack_layout = None if stack is None else stack.layout
        self._stack_keep = () if stack is None else stack.keep

    def arguments(self, base: tuple, lora, chunks=(), places=()) -> tuple:
        """The graph's inputs: the runner's (``base``), then, with adapter slots, ``lora``."""
        if self.adapter_slots is None:
            return base
        return (*base, np.ascontiguousarray(lora, np.int32))


class AotLlama(_Llama):
    """Attention inputs: table [R, NB] int32, the block table (padded with the scratch block 0), and
    token_rows [B*T] int32, each token's table row (so one row of T tokens can pack several prompts). Rows
    flat [B*T, ...] all the way through (ids/pos keep their [B, T] shape; the kernels read them as B*T
    elements); one op in (embedding and rotary rows), the decoder layers (one op for all of them, ``decoder_stack``,
    where ``stack_meta`` allows; else one a layer), one out (final norm, logit rows, LM head). Float32, the KV cache
    in ``kv_dtype`` (kv_dtype.py)."""

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], num_blocks: int, block_size: int,
                 max_positions: int, aot, lora: tuple[int, int] | None = None, kv_dtype: str = "float32") -> None:
        super().__init__(lora)
        self.aot = aot
        head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
        self.head = aot_weight([head], "lm_head")
        self.embedding = aot_embedding(spec, w, self.head, aot)  # rows of the head's own blocks when tied Q8_0
        cos, sin = rope_tables(spec.head_dim, max_positions, spec.rope_theta)
        self.cos, self.sin = param(cos, "rope_cos"), param(sin, "rope_sin")
        slots = num_blocks * block_size
        self.layers = nn.CellList([self.layer(spec, w, i, slots, block_size, aot, lora, kv_dtype)
                                   for i in range(spec.num_layers)])
        self.norm = AotRMSNorm(w["model.norm.weight"], spec.rms_norm_eps, "norm", aot)
        self.use_stack(layer_stack(self.layers))

    @staticmethod
    def layer(spec: ModelSpec, w: dict, i: int, slots: int, block_size: int, aot, lora, kv_dtype: str) -> nn.Cell:
        """Decoder layer ``i``: with adapter slots where there are some."""
        if lora is None:
            return AotDecoderLayer(spec, w, i, slots, block_size, aot, kv_dtype)
        return AotLoraDecoderLayer(spec, w, i, slots, block_size, aot, *lora, kv_dtype=kv_dtype)

    def lm_head(self) -> nn.Cell:
        return AotLMHead(self.head, self.aot)

    def construct(self, ids, pos, write_idx, table, token_rows, last_rows, lora=None):
        x, cos, sin = self.embedding(ids, pos, self.cos, self.sin)  # [N, dim], [N, hd], [N, hd]
        if self.stack_meta is not None:
            x = self.aot.decoder_stack(x, write_idx, table, pos, token_rows, self.stack_meta, self.stack_layout, cos,
                                       sin)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, pos, write_idx, table, token_rows, lora)
        return self.aot.norm_head(x, self.norm.weight, self.norm.eps_t, last_rows, self.head)


class StockLlama(_Llama):
    """Attention inputs: read_rows [kv, B, W] int32 (cache row of each head and key position of a row's
    window, padded with slot 0) and mask [B, 1, T, W] float32 (0 where key j <= pos, else -1e9). Computes in
    ``dtype`` (the yaml's compute_dtype)."""

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], num_blocks: int, block_size: int,
                 max_positions: int, dtype: str = "float32", lora: tuple[int, int] | None = None) -> None:
        super().__init__(lora)
        self.dim = spec.hidden_size
        self.dtype = dt = DTYPES[dtype]
        self.low_precision = dt != ms.float32
        self.embed = param(w["model.embed_tokens.weight"], "embed", dt)
        head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
        self.head = stock_weight([head], "lm_head", dt)  # [D, V]: a separate copy even when tied
        cos, sin = rope_tables(spec.head_dim, max_positions, spec.rope_theta)
        self.cos, self.sin = param(cos, "rope_cos", dt), param(sin, "rope_sin", dt)
        self.layers = nn.CellList([self.layer(spec, w, i, num_blocks * block_size, dt, lora)
                                   for i in range(spec.num_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], spec.rms_norm_eps, "norm", dt)

    @staticmethod
    def layer(spec: ModelSpec, w: dict, i: int, slots: int, dtype, lora) -> nn.Cell:
        """Decoder layer ``i`` (adapter deltas inside it where ``lora`` gives slots)."""
        return StockDecoderLayer(spec, w, i, slots, dtype, lora)

    def lm_head(self) -> nn.Cell:
        return StockLMHead(self.head, self.dtype)

    def construct(self, ids, pos, write_idx, read_rows, mask, last_rows, lora=None):
        b, t = ids.shape
        x = ops.gather(self.embed, ids, 0)  # [B, T, D]
        cos = ops.expand_dims(ops.gather(self.cos, pos, 0), 2)  # [B, T, 1, hd]
        sin = ops.expand_dims(ops.gather(self.sin, pos, 0), 2)
        if self.low_precision:
            mask = ops.cast(mask, self.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, write_idx, read_rows, mask, lora)
        hidden = self.norm(ops.reshape(x, (b * t, self.dim)))
        logits = ops.matmul(ops.gather(hidden, last_rows, 0), self.head)  # [B, V]
        if self.low_precision:
            return ops.cast(logits, ms.float32), ops.cast(hidden, ms.float32)
        return logits, hidden


class AotLMHead(nn.Cell):
    """Logits for already-normed hidden rows ``[N, D]`` (prompt logprobs); shares the model's head weights."""

    def __init__(self, head, aot) -> None:
        super().__init__()
        self.head, self.aot = head, aot

    def construct(self, hidden):
        return self.aot.matmul(hidden, self.head)


class StockLMHead(nn.Cell):
    """Logits for already-normed hidden rows ``[N, D]`` (float32 in and out); shares the model's head weights."""

    def __init__(self, head, dtype) -> None:
        super().__init__()
        self.head, self.dtype = head, dtype
        self.low_precision = dtype != ms.float32

    def construct(self, hidden):
        if self.low_precision:
            return ops.cast(ops.matmul(ops.cast(hidden, self.dtype), self.head), ms.float32)
        return ops.matmul(hidden, self.head)
