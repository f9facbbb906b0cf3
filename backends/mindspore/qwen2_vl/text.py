"""The Qwen2-VL language model as one MindSpore cell: ``backends.mindspore.model``'s ``DecoderLayer`` stack
(Qwen2: q/k/v biases, GQA, SwiGLU; its own paged K/V cache per layer) and ``RMSNorm``, with two
differences from ``LlamaModel``: media rows are spliced into the token embeddings, and the rotary cos/sin
of each token come from its three M-RoPE positions.

Inputs, for B rows of T tokens: ids [B, T] int32; media [B, T, D] float32 (the vision tower's output at
the image/video placeholder tokens, zeros elsewhere) and media_mask [B, T, 1] float32 (1 at those tokens);
mpos [3, B, T] int32 (temporal/height/width positions); then what ``DecoderLayer`` takes on the stock-op
path: pos [B, T] int32 (each token's cache index), write_idx, read rows [kv, B, W] and the mask
[B, 1, T, W] (causal over cache indices, not over M-RoPE positions); last_rows [R] (flat rows whose
logits to return). Out: logits [R, V] and the final-normed hidden rows [B*T, D].

With the AOT kernels (``aot``, as ``PackedRunner`` runs the text models) the rows stay flat [B*T, ...]
and, as for ``LlamaModel``, index is the block table [R, NB] and aux each token's table row [B*T]; the
paged attention kernel is causal over ``pos``, the cache index, while cos/sin carry the M-RoPE angles.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from backends.mindspore.model import DecoderLayer, RMSNorm, _param, _weight, rope_tables
from backends.mindspore.qwen2_vl.config import VLSpec
from backends.mindspore.qwen2_vl.positions import mrope_selector


class Qwen2VLText(nn.Cell):
    def __init__(self, spec: VLSpec, w: dict[str, np.ndarray], num_blocks: int, block_size: int,
                 max_positions: int, aot=None) -> None:
        super().__init__()
        t = spec.text
        self.dim = t.hidden_size
        self.aot, self.fused = aot, aot is not None
        self.dtype, self.low_precision = ms.float32, False  # float32 throughout (what ``LMHead`` reads)
        self.embed = _param(w["model.embed_tokens.weight"], "embed")
        head = w["model.embed_tokens.weight"] if t.tie_word_embeddings else w["lm_head.weight"]
        self.head = _weight([head], "lm_head", self.fused)  # HF [out, in] rows (model._weight)
        cos, sin = rope_tables(t.head_dim, max_positions, t.rope_theta)
        self.cos, self.sin = _param(cos, "rope_cos"), _param(sin, "rope_sin")
        # one stream per rotary dimension (M-RoPE's sections): [3, 1, hd] flat rows, [3, 1, 1, hd] [B, T] rows
        select = mrope_selector(spec.mrope_section, t.head_dim)[:, None, :]
        self.select = Tensor(select if self.fused else select[:, :, None, :])
        self.layers = nn.CellList([DecoderLayer(t, w, i, num_blocks * block_size, block_size, aot)
                                   for i in range(t.num_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], t.rms_norm_eps, "norm", aot)
        self.sum = ops.ReduceSum()

    def _rotary(self, table, mpos):
        # gather each stream's row, keep each dimension from its own stream
        return self.sum(ops.gather(table, mpos, 0) * self.select, 0)

    def construct(self, ids, media, media_mask, mpos, pos, write_idx, index, aux, last_rows):
        b, t = ids.shape
        if self.fused:  # rows flat [B*T, ...] all the way through
            n = b * t
            x = ops.gather(self.embed, ops.reshape(ids, (n,)), 0) * (1.0 - ops.reshape(media_mask, (n, 1)))
            x = x + ops.reshape(media, (n, self.dim))
            flat = ops.reshape(mpos, (3, n))
            cos, sin = self._rotary(self.cos, flat), self._rotary(self.sin, flat)  # [N, hd]
            pos = ops.reshape(pos, (n,))
        else:
            x = ops.gather(self.embed, ids, 0) * (1.0 - media_mask) + media
            cos = ops.expand_dims(self._rotary(self.cos, mpos), 2)  # [B, T, 1, hd]
            sin = ops.expand_dims(self._rotary(self.sin, mpos), 2)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, write_idx, index, aux)
        hidden = self.norm(ops.reshape(x, (b * t, self.dim)))
        last = ops.gather(hidden, last_rows, 0)
        return (self.aot.matmul(last, self.head) if self.fused else ops.matmul(last, self.head)), hidden
