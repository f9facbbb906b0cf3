"""Positions, host side (NumPy): the language model's multimodal rotary positions (M-RoPE), the vision
tower's 2-D rotary angles, the per-frame attention mask and Qwen2.5-VL's window layout.

M-RoPE gives every prompt token three positions (temporal, height, width). Text tokens carry one running
index on all three. An image or video of ``t x h x w`` merged units starting after index ``s`` gets
``(s + tau(i), s + row, s + col)`` (``tau(i) = i`` for Qwen2-VL; for Qwen2.5-VL video
``trunc(i * second_per_grid * tokens_per_second)``, in float32 as the reference computes it), and the
text after it resumes at the block's largest position + 1. After the prompt, a token at cache index
``n`` has position ``n + delta`` on all three (``delta`` = largest prompt position + 1 - prompt length).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backends.mindspore.families.qwen2_vl.preprocess import MediaError, Patches

NEG = np.float32(-1e9)


def rope_index(ids: Sequence[int], items: Sequence[Patches], image_token: int, video_token: int,
               merge_size: int, tokens_per_second: float, timed_video: bool) -> tuple[np.ndarray, int]:
    """([3, L] int64 positions, delta) for an expanded prompt; ``items`` the prompt's media in order.

    ``timed_video``: Qwen2.5-VL's temporal positions in units of 1 / tokens_per_second seconds.
    """
    ids = list(ids)
    queues = {image_token: [p for p in items if p.kind == "image"],
              video_token: [p for p in items if p.kind == "video"]}
    columns: list[np.ndarray] = []
    start = i = 0
    while i < len(ids):
        if ids[i] not in queues:
            j = i
            while j < len(ids) and ids[j] not in queues:
                j += 1
            columns.append(np.broadcast_to(np.arange(start, start + j - i), (3, j - i)))
            start += j - i
            i = j
            continue
        if not queues[ids[i]]:
            raise MediaError(f"token {ids[i]} at {i} has no media item left to stand for")
        item = queues[ids[i]].pop(0)
        block = _vision_positions(item, merge_size, tokens_per_second, timed_video) + start
        n = block.shape[1]
        if ids[i:i + n] != [ids[i]] * n:
            raise MediaError(f"the {item.kind} at token {i} needs {n} placeholder tokens in a row")
        columns.append(block)
        start = int(block.max()) + 1
        i += n
    positions = np.concatenate(columns, axis=1) if columns else np.zeros((3, 0), np.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions.astype(np.int64), delta


def _vision_positions(item: Patches, merge_size: int, tokens_per_second: float, timed: bool) -> np.ndarray:
    t, h, w = item.grid[0], item.grid[1] // merge_size, item.grid[2] // merge_size
    steps = np.arange(t)
    if timed and item.kind == "video":
        steps = (steps.astype(np.float32) * np.float32(item.second_per_grid) * np.float32(tokens_per_second))
        steps = np.trunc(steps).astype(np.int64)
    tt, hh, ww = np.meshgrid(steps, np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]).astype(np.int64)


def mrope_selector(section: Sequence[int], head_dim: int) -> np.ndarray:
    """[3, head_dim] one-hot: which of the three position streams rotates each dimension (the sections
    t, h, w over the first half of the frequencies, repeated over the second half)."""
    sel = np.zeros((3, head_dim), np.float32)
    owner = np.concatenate([np.full(n, k) for k, n in enumerate(section)])
    owner = np.concatenate([owner, owner])
    sel[owner, np.arange(head_dim)] = 1.0
    return sel


def patch_rows_cols(grid: tuple[int, int, int], merge_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, col) in its frame, in the processor's patch order (merge block by merge block)."""
    t, h, w = grid
    rows = np.broadcast_to(np.arange(h)[:, None], (h, w))
    cols = np.broadcast_to(np.arange(w)[None, :], (h, w))

    def order(x: np.ndarray) -> np.ndarray:
        return x.reshape(h // merge_size, merge_size, w // merge_size, merge_size).transpose(0, 2, 1, 3).reshape(-1)

    return np.tile(order(rows), t), np.tile(order(cols), t)


def vision_cos_sin(grid: tuple[int, int, int], merge_size: int, head_dim: int,
                   theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [N, head_dim]: the first quarter of the frequencies rotate by the patch's row, the second by
    its column (rotary over head_dim / 2), both halves repeated for rotate_half."""
    dim = head_dim // 2
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)
    rows, cols = patch_rows_cols(grid, merge_size)
    angles = np.concatenate([np.outer(rows.astype(np.float32), inv_freq),
                             np.outer(cols.astype(np.float32), inv_freq)], axis=1)
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def frame_ids(grid: tuple[int, int, int]) -> np.ndarray:
    """Each patch's frame (temporal patch) index: full attention stays within a frame."""
    t, h, w = grid
    return np.repeat(np.arange(t), h * w)


def window_ids(grid: tuple[int, int, int], merge_size: int, window_units: int) -> np.ndarray:
    """Each patch's window (Qwen2.5-VL): squares of ``window_units`` merged units per frame, the last
    row/column of windows cut short by the frame's edge."""
    t, h, w = grid
    rows, cols = patch_rows_cols(grid, merge_size)
    side = merge_size * window_units
    per_row = -(-w // side)
    per_frame = -(-h // side) * per_row
    return frame_ids(grid) * per_frame + (rows // side) * per_row + cols // side


def segment_mask(segments: np.ndarray, size: int) -> np.ndarray:
    """Additive mask [size, size]: 0 where query and key share a segment, else -1e9. Rows past the
    segments (bucket padding) see only themselves."""
    n = len(segments)
    seg = np.concatenate([segments.astype(np.int64), -1 - np.arange(size - n)])
    return np.where(seg[:, None] == seg[None, :], np.float32(0), NEG).astype(np.float32)


@dataclass(frozen=True, slots=True)
class WindowLayout:
    """Patches gathered window by window for batched attention: ``index`` [W*S] the patch in each window
    slot (``pad`` = the row past the patches, a zero row), ``key_mask`` [W, 1, 1, S] (0 on a real patch,
    -1e9 on a pad slot), ``inverse`` [n] each patch's slot in the W*S layout (rows past the segments: 0)."""

    index: np.ndarray
    key_mask: np.ndarray
    inverse: np.ndarray


def window_layout(segments: np.ndarray, size: int, slots: int, windows: int) -> WindowLayout:
    """The layout of ``segments`` (each patch's window id, 0..k-1) over ``size`` patch rows, ``windows``
    windows (>= k; the extra ones all padding) of ``slots`` patches each."""
    counts = np.bincount(segments)
    if len(counts) > windows or counts.max() > slots:
        raise ValueError(f"{len(counts)} windows of up to {counts.max()} patches exceed the layout "
                         f"{windows} x {slots}")
    order = np.argsort(segments, kind="stable")
    index = np.full((windows, slots), size, np.int32)
    key_mask = np.full((windows, 1, 1, slots), NEG, np.float32)
    inverse = np.zeros(size, np.int32)
    start = 0
    for w, count in enumerate(counts):
        members = order[start:start + count]
        index[w, :count] = members
        key_mask[w, 0, 0, :count] = 0.0
        inverse[members] = w * slots + np.arange(count)
        start += count
    return WindowLayout(index.reshape(-1), key_mask, inverse)
