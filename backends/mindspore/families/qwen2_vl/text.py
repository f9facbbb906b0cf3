"""The Qwen2-VL language model as one MindSpore cell, in the two strategies of ``backends.mindspore.network``:
``AotQwen2VLText`` (the AOT layers, as ``PackedRunner`` runs it) and ``StockQwen2VLText`` (the stock-op
layers, as ``SplitRunner`` runs it). Its decoder layer stack (Qwen2: q/k/v biases, GQA, SwiGLU; its own paged
K/V cache per layer) and ``RMSNorm``, with two differences from ``network/llama.py``: media rows are spliced
into the token embeddings, and the rotary cos/sin of each token come from its three M-RoPE positions.

Inputs, for B rows of T tokens: ids [B, T] int32; media [B, T, D] float32 (the vision tower's output at the
image/video placeholder tokens, zeros elsewhere) and media_mask [B, T, 1] float32 (1 at those tokens); mpos
[3, B, T] int32 (temporal/height/width positions); then what ``StockDecoderLayer`` takes: pos [B, T] int32
(each token's cache index), write_idx, read rows [kv, B, W] and the mask [B, 1, T, W] (causal over cache
indices, not over M-RoPE positions); last_rows [R] (flat rows whose logits to return). Out: logits [R, V] and
the final-normed hidden rows [B*T, D].

On the AOT kernels the rows stay flat [B*T, ...] and, as for ``AotLlama``, the attention inputs are the block
table [R, NB] and each token's table row [B*T]; the paged attention kernel is causal over ``pos``, the cache
index, while cos/sin carry the M-RoPE angles.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from backends.mindspore.network.aot_layer import AotDecoderLayer
from backends.mindspore.network.common import AotRMSNorm, RMSNorm, aot_weight, param, rope_tables, stock_weight
from backends.mindspore.network.llama import AotLMHead, StockLMHead
from backends.mindspore.network.stock_layer import StockDecoderLayer
from backends.mindspore.families.qwen2_vl.positions import mrope_selector
from backends.mindspore.modeldir.spec import ModelSpec, VLSpec


def media_inputs(chunks: list, places: list[tuple[int, int]], pos: np.ndarray,
                 dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A vision-language network's extra inputs for tokens laid out as ``pos`` [B, T], chunk i's tokens from
    (row, column) ``places[i]``: media rows [B, T, D], mask [B, T, 1] and M-RoPE positions [3, B, T]
    (padding and text: the cache index, plus each chunk's delta)."""
    b, t = pos.shape
    media, mask = np.zeros((b, t, dim), np.float32), np.zeros((b, t, 1), np.float32)
    mpos = np.broadcast_to(pos, (3, b, t)).astype(np.int32)
    for c, (row, at) in zip(chunks, places):
        n = len(c.ids)
        if c.mpos is not None:
            mpos[:, row, at:at + n] = c.mpos
        elif c.delta:
            mpos[:, row, at:at + n] += c.delta
        if c.media is not None:
            media[row, at:at + n], mask[row, at:at + n, 0] = c.media
    return media, mask, mpos


class _Qwen2VLText(nn.Cell):
    """What both strategies share: the embedding, the rotary tables and the M-RoPE selector."""

    def __init__(self, spec: VLSpec, w: dict[str, np.ndarray], max_positions: int, select: np.ndarray) -> None:
        super().__init__()
        t = spec.text
        self.dim = t.hidden_size
        self.embed = param(w["model.embed_tokens.weight"], "embed")
        cos, sin = rope_tables(t.head_dim, max_positions, t.rope_theta)
        self.cos, self.sin = param(cos, "rope_cos"), param(sin, "rope_sin")
        self.select = Tensor(select)
        self.sum = ops.ReduceSum()

    def _rotary(self, table, mpos):
        # gather each stream's row, keep each dimension from its own stream
        return self.sum(ops.gather(table, mpos, 0) * self.select, 0)

    def arguments(self, base: tuple, lora, chunks=(), places=()) -> tuple:
        """The graph's inputs: the runner's (``base``: ids, pos, ...) with the media rows, their mask and the
        M-RoPE positions of ``chunks`` after ids (no adapter slots)."""
        return (base[0], *media_inputs(chunks, places, base[1], self.dim), *base[1:])


def _head(spec: VLSpec, w: dict[str, np.ndarray]) -> np.ndarray:
    return w["model.embed_tokens.weight"] if spec.text.tie_word_embeddings else w["lm_head.weight"]


class AotQwen2VLText(_Qwen2VLText):
    """Rows flat [B*T, ...]; index the block table [R, NB], aux each token's table row [B*T]."""

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], num_blocks: int, block_size: int,
                 max_positions: int, aot, lora: None = None, kv_dtype: str = "float32") -> None:
        t, spec = spec, spec.vision  # no adapter slots (its family declares none)
        # one stream per rotary dimension (M-RoPE's sections): [3, 1, hd] for flat rows
        super().__init__(spec, w, max_positions, mrope_selector(spec.mrope_section, t.head_dim)[:, None, :])
        self.aot = aot
        self.head = aot_weight([_head(spec, w)], "lm_head")
        self.layers = nn.CellList([AotDecoderLayer(t, w, i, num_blocks * block_size, block_size, aot, kv_dtype)
                                   for i in range(t.num_layers)])
        self.norm = AotRMSNorm(w["model.norm.weight"], t.rms_norm_eps, "norm", aot)

    def lm_head(self) -> nn.Cell:
        return AotLMHead(self.head, self.aot)

    def construct(self, ids, media, media_mask, mpos, pos, write_idx, table, token_rows, last_rows):
        b, t = ids.shape
        n = b * t
        x = ops.gather(self.embed, ops.reshape(ids, (n,)), 0) * (1.0 - ops.reshape(media_mask, (n, 1)))
        x = x + ops.reshape(media, (n, self.dim))
        flat = ops.reshape(mpos, (3, n))
        cos, sin = self._rotary(self.cos, flat), self._rotary(self.sin, flat)  # [N, hd]
        pos = ops.reshape(pos, (n,))
        for layer in self.layers:
            x = layer(x, cos, sin, pos, write_idx, table, token_rows)
        hidden = self.norm(x)
        return self.aot.matmul(ops.gather(hidden, last_rows, 0), self.head), hidden


class StockQwen2VLText(_Qwen2VLText):
    """Rows [B, T, ...]; read rows [kv, B, W] and the mask [B, 1, T, W]. Float32 throughout."""

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], num_blocks: int, block_size: int,
                 max_positions: int, dtype: str = "float32", lora: None = None) -> None:
        t, spec = spec, spec.vision  # float32 only and no adapter slots, as its family declares
        # one stream per rotary dimension (M-RoPE's sections): [3, 1, 1, hd] for [B, T] rows
        super().__init__(spec, w, max_positions, mrope_selector(spec.mrope_section, t.head_dim)[:, None, None, :])
        self.head = stock_weight([_head(spec, w)], "lm_head")
        self.layers = nn.CellList([StockDecoderLayer(t, w, i, num_blocks * block_size)
                                   for i in range(t.num_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], t.rms_norm_eps, "norm")

    def lm_head(self) -> nn.Cell:
        return StockLMHead(self.head, ms.float32)

    def construct(self, ids, media, media_mask, mpos, pos, write_idx, read_rows, mask, last_rows):
        b, t = ids.shape
        x = ops.gather(self.embed, ids, 0) * (1.0 - media_mask) + media
        cos = ops.expand_dims(self._rotary(self.cos, mpos), 2)  # [B, T, 1, hd]
        sin = ops.expand_dims(self._rotary(self.sin, mpos), 2)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, write_idx, read_rows, mask)
        hidden = self.norm(ops.reshape(x, (b * t, self.dim)))
        return ops.matmul(ops.gather(hidden, last_rows, 0), self.head), hidden
