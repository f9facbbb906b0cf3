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
"""
from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

from backends.mindspore.model import DecoderLayer, RMSNorm, _param, rope_tables
from backends.mindspore.qwen2_vl.config import VLSpec
from backends.mindspore.qwen2_vl.positions import mrope_selector


class Qwen2VLText(nn.Cell):
    def __init__(self, spec: VLSpec, w: dict[str, np.ndarray], num_blocks: int, block_size: int,
                 max_positions: int) -> None:
        super().__init__()
        t = spec.text
        self.dim = t.hidden_size
        self.embed = _param(w["model.embed_tokens.weight"], "embed")
        head = w["model.embed_tokens.weight"] if t.tie_word_embeddings else w["lm_head.weight"]
        self.head = _param(head.T, "lm_head")
        cos, sin = rope_tables(t.head_dim, max_positions, t.rope_theta)
        self.cos, self.sin = _param(cos, "rope_cos"), _param(sin, "rope_sin")
        # [3, 1, 1, hd]: one stream per rotary dimension (M-RoPE's sections)
        self.select = Tensor(mrope_selector(spec.mrope_section, t.head_dim)[:, None, None, :])
        self.layers = nn.CellList([DecoderLayer(t, w, i, num_blocks * block_size, block_size)
                                   for i in range(t.num_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], t.rms_norm_eps, "norm")
        self.sum = ops.ReduceSum()

    def _rotary(self, table, mpos):
        # gather each stream's row, keep each dimension from its own stream: [B, T, 1, hd]
        return ops.expand_dims(self.sum(ops.gather(table, mpos, 0) * self.select, 0), 2)

    def construct(self, ids, media, media_mask, mpos, pos, write_idx, read_rows, mask, last_rows):
        b, t = ids.shape
        x = ops.gather(self.embed, ids, 0) * (1.0 - media_mask) + media
        cos, sin = self._rotary(self.cos, mpos), self._rotary(self.sin, mpos)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, write_idx, read_rows, mask)
        hidden = self.norm(ops.reshape(x, (b * t, self.dim)))
        return ops.matmul(ops.gather(hidden, last_rows, 0), self.head), hidden
