"""The Qwen2-VL / Qwen2.5-VL vision tower as one MindSpore cell (stock ops, float32, GRAPH mode).

Patches [N, C*T*P*P] (N padded to a compiled bucket) -> patch embedding (the Conv3d whose kernel is the
whole patch, i.e. one matmul) -> ``depth`` pre-norm blocks (attention with the 2-D rotary on q/k under an
additive mask, then the MLP) -> the patch merger (norm, each 2x2 group of consecutive patches
concatenated, Linear-GELU-Linear) -> [N/4, out_dim], one row per language-model token.

Full attention (Qwen2-VL's blocks, Qwen2.5-VL's ``fullatt_block_indexes``) runs over all N patches under
the host's additive mask (patches see their own frame; bucket padding sees itself), so one graph serves
any grid of its bucket size. Qwen2.5-VL's window blocks gather q/k/v window by window ([W, S] slots: W
windows of up to S = 64 patches, padded) and attend in one batch, O(N * S) instead of O(N^2); the
reference's reorder of the whole sequence window by window and back becomes this gather and its inverse.
"""
from __future__ import annotations

import numpy as np
from mindspore import nn, ops

from backends.mindspore.network.common import RMSNorm
from backends.mindspore.network.common import param as _param
from backends.mindspore.families.qwen2_vl.config import VisionSpec


class LayerNorm(nn.Cell):
    def __init__(self, weight: np.ndarray, bias: np.ndarray, eps: float, name: str) -> None:
        super().__init__()
        self.weight, self.bias = _param(weight, name + ".weight"), _param(bias, name + ".bias")
        self.eps = eps

    def construct(self, x):
        centred = x - ops.mean(x, -1, keep_dims=True)
        var = ops.mean(centred * centred, -1, keep_dims=True)
        return centred * ops.rsqrt(var + self.eps) * self.weight + self.bias


def _norm(spec: VisionSpec, w: dict[str, np.ndarray], name: str, eps: float = 1e-6) -> nn.Cell:
    if spec.family == "qwen2_vl":
        return LayerNorm(w[name + ".weight"], w[name + ".bias"], eps, name)
    return RMSNorm(w[name + ".weight"], eps, name)


class _Linear(nn.Cell):
    """y = x @ W.T + b with W given [out, in] (HF), kept [in, out] for a plain matmul."""

    def __init__(self, w: dict[str, np.ndarray], name: str) -> None:
        super().__init__()
        self.weight = _param(w[name + ".weight"].T, name + ".weight")
        self.bias = _param(w[name + ".bias"], name + ".bias")

    def construct(self, x):
        return ops.matmul(x, self.weight) + self.bias


class VisionBlock(nn.Cell):
    def __init__(self, spec: VisionSpec, w: dict[str, np.ndarray], i: int) -> None:
        super().__init__()
        p = f"visual.blocks.{i}."
        self.heads, self.head_dim = spec.num_heads, spec.head_dim
        self.scale = float(spec.head_dim) ** -0.5
        self.norm1, self.norm2 = _norm(spec, w, p + "norm1"), _norm(spec, w, p + "norm2")
        self.qkv, self.proj = _Linear(w, p + "attn.qkv"), _Linear(w, p + "attn.proj")
        self.gated = spec.family == "qwen2_5_vl"
        if self.gated:
            self.gate, self.up, self.down = (_Linear(w, p + f"mlp.{n}_proj") for n in ("gate", "up", "down"))
        else:
            self.fc1, self.fc2 = _Linear(w, p + "mlp.fc1"), _Linear(w, p + "mlp.fc2")
        self.act = spec.hidden_act
        # Qwen2-VL: every block full (per-frame) attention; Qwen2.5-VL: windows, but in the listed blocks.
        self.full = spec.family == "qwen2_vl" or i in spec.full_attention_blocks
        self.bmm = ops.BatchMatMul()
        self.bmm_t = ops.BatchMatMul(transpose_b=True)

    def _activation(self, x):
        if self.act == "quick_gelu":
            return x * ops.sigmoid(1.702 * x)
        if self.act == "silu":
            return ops.silu(x)
        return ops.gelu(x, approximate="none")

    def _rope(self, x, cos, sin):
        half = self.head_dim // 2
        return x * cos + ops.concat((-x[..., half:], x[..., :half]), -1) * sin

    def _qkv(self, x, cos, sin):
        """q, k (rotated), v: [N, heads, hd] each."""
        qkv = ops.reshape(self.qkv(x), (x.shape[0], 3, self.heads, self.head_dim))
        return self._rope(qkv[:, 0], cos, sin), self._rope(qkv[:, 1], cos, sin), qkv[:, 2]

    def _full_attention(self, x, cos, sin, mask):
        """All N patches at once under ``mask`` [N, N]."""
        q, k, v = (ops.transpose(t, (1, 0, 2)) for t in self._qkv(x, cos, sin))  # [heads, N, hd]
        probs = ops.softmax(self.bmm_t(q, k) * self.scale + mask, -1)
        out = ops.transpose(self.bmm(probs, v), (1, 0, 2))
        return ops.reshape(out, (x.shape[0], self.heads * self.head_dim))

    def _windows(self, t, index, w, s):
        """[N, heads, hd] -> [W*heads, S, hd]: each window's slots (the pad slot reads a zero row)."""
        t = ops.gather(ops.concat((t, ops.zeros_like(t[:1])), 0), index, 0)
        t = ops.transpose(ops.reshape(t, (w, s, self.heads, self.head_dim)), (0, 2, 1, 3))
        return ops.reshape(t, (w * self.heads, s, self.head_dim))

    def _window_attention(self, x, cos, sin, index, inverse, key_mask):
        """Each window's patches among themselves: index [W*S], inverse [N], key_mask [W, 1, 1, S]."""
        w, s = key_mask.shape[0], key_mask.shape[3]
        q, k, v = (self._windows(t, index, w, s) for t in self._qkv(x, cos, sin))
        scores = ops.reshape(self.bmm_t(q, k) * self.scale, (w, self.heads, s, s)) + key_mask
        probs = ops.reshape(ops.softmax(scores, -1), (w * self.heads, s, s))
        out = ops.transpose(ops.reshape(self.bmm(probs, v), (w, self.heads, s, self.head_dim)), (0, 2, 1, 3))
        return ops.gather(ops.reshape(out, (w * s, self.heads * self.head_dim)), inverse, 0)

    def construct(self, x, cos, sin, full_mask, index, inverse, key_mask):
        h = self.norm1(x)
        if self.full:
            x = x + self.proj(self._full_attention(h, cos, sin, full_mask))
        else:
            x = x + self.proj(self._window_attention(h, cos, sin, index, inverse, key_mask))
        h = self.norm2(x)
        if self.gated:
            return x + self.down(self._activation(self.gate(h)) * self.up(h))
        return x + self.fc2(self._activation(self.fc1(h)))


class PatchMerger(nn.Cell):
    def __init__(self, spec: VisionSpec, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.norm = _norm(spec, w, "visual.merger.ln_q")
        self.group = spec.width * spec.merge_size ** 2
        self.fc1, self.fc2 = _Linear(w, "visual.merger.mlp.0"), _Linear(w, "visual.merger.mlp.2")

    def construct(self, x):
        x = ops.reshape(self.norm(x), (-1, self.group))
        return self.fc2(ops.gelu(self.fc1(x), approximate="none"))


class VisionTower(nn.Cell):
    """patches [N, patch_dim], cos/sin [N, head_dim], full_mask [N, N], the window layout (index [W*S],
    inverse [N], key_mask [W, 1, 1, S]; unused without window blocks) -> [N / merge^2, out_dim]."""

    def __init__(self, spec: VisionSpec, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        conv = w["visual.patch_embed.proj.weight"]  # [width, C, T, P, P]: one dot product per patch
        self.patch_embed = _param(conv.reshape(spec.width, -1).T, "visual.patch_embed")
        self.blocks = nn.CellList([VisionBlock(spec, w, i) for i in range(spec.depth)])
        self.merger = PatchMerger(spec, w)

    def construct(self, patches, cos, sin, full_mask, index, inverse, key_mask):
        x = ops.matmul(patches, self.patch_embed)
        cos, sin = ops.expand_dims(cos, 1), ops.expand_dims(sin, 1)  # [N, 1, hd] over the heads
        for block in self.blocks:
            x = block(x, cos, sin, full_mask, index, inverse, key_mask)
        return self.merger(x)

