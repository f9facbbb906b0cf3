"""The Qwen2-VL processor's image and video-frame preprocessing in NumPy/Pillow, and the placeholder
expansion of the prompt's vision tokens.

An image: RGB (transparency over white), resized with Pillow's bicubic filter to ``smart_resize``'s size
(both sides multiples of patch*merge = 28, area within [min_pixels, max_pixels], aspect kept), scaled by
1/255, normalised with the CLIP mean/std, repeated ``temporal_patch_size`` times and cut into patches of
``C * T * 14 * 14`` values, ordered merge block by merge block (the 2x2 patches that become one
language-model token are consecutive). A video: its sampled frames resized to the first frame's
smart_resize size, padded to a multiple of ``temporal_patch_size`` with the last frame, then patched
the same way, consecutive frames sharing a patch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from backends.mindspore.families.qwen2_vl.config import ProcessorSpec

MAX_ASPECT = 200


class MediaError(ValueError):
    """An image or video the preprocessing cannot take; the message names what and why."""


@dataclass(frozen=True, slots=True)
class Patches:
    """One image or video, ready for the vision tower."""

    pixel_values: np.ndarray  # [t*h*w, C*T*P*P] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    kind: str  # "image" | "video"
    second_per_grid: float = 1.0  # video: seconds one temporal patch spans (temporal_patch_size / fps)

    def tokens(self, merge_size: int) -> int:
        """Language-model tokens this item takes (one per merge x merge patches)."""
        t, h, w = self.grid
        return t * h * w // (merge_size * merge_size)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor`` with the area brought within [min, max] pixels."""
    if min(height, width) <= 0:
        raise MediaError(f"image size {width}x{height} has an empty side")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise MediaError(f"image size {width}x{height}: aspect ratio over {MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with transparency is composited over white first."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _normalised(image: Image.Image, size: tuple[int, int], spec: ProcessorSpec) -> np.ndarray:
    """[C, H, W] float32: resized (bicubic) to ``size`` (h, w), scaled to [0, 1], mean/std normalised."""
    h, w = size
    if image.size != (w, h):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    x = (np.asarray(image, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(spec.image_mean, np.float32)) / np.asarray(spec.image_std, np.float32)
    return x.transpose(2, 0, 1)


def _patchify(frames: np.ndarray, spec: ProcessorSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """frames [F, C, H, W] (F a multiple of temporal_patch_size) -> [t*h*w, C*T*P*P], (t, h, w)."""
    f, c, height, width = frames.shape
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    t, gh, gw = f // tp, height // p, width // p
    x = frames.reshape(t, tp, c, gh // m, m, p, gw // m, m, p)
    # -> t, block row, block col, row in block, col in block, C, T, patch row, patch col
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * gh * gw, c * tp * p * p)), (t, gh, gw)


def preprocess_image(image: Image.Image, spec: ProcessorSpec) -> Patches:
    image = to_rgb(image)
    size = smart_resize(image.height, image.width, spec.factor, spec.min_pixels, spec.max_pixels)
    frame = _normalised(image, size, spec)
    pixel_values, grid = _patchify(np.repeat(frame[None], spec.temporal_patch_size, axis=0), spec)
    return Patches(pixel_values, grid, "image")


def preprocess_video(frames: Sequence[np.ndarray] | np.ndarray, spec: ProcessorSpec,
                     fps: float | None = None) -> Patches:
    """Sampled frames ([H, W, 3] uint8 each, all one size) -> patches; ``fps`` the rate they were sampled at."""
    if len(frames) == 0:
        raise MediaError("a video needs at least one frame")
    first = np.asarray(frames[0])
    if first.ndim != 3 or first.shape[2] != 3:
        raise MediaError(f"video frames must be [H, W, 3], got {list(first.shape)}")
    size = smart_resize(first.shape[0], first.shape[1], spec.factor, spec.min_pixels, spec.max_pixels)
    stack = [_normalised(Image.fromarray(np.asarray(f, dtype=np.uint8), "RGB"), size, spec) for f in frames]
    pad = -len(stack) % spec.temporal_patch_size
    stack.extend([stack[-1]] * pad)
    pixel_values, grid = _patchify(np.stack(stack), spec)
    rate = spec.video_fps if fps is None else fps
    return Patches(pixel_values, grid, "video", second_per_grid=spec.temporal_patch_size / rate)


def sample_frame_indices(total: int, video_fps: float, spec: ProcessorSpec) -> list[int]:
    """Which of a video's ``total`` frames to keep: ``spec.video_fps`` per second of video (or
    ``spec.video_frames`` in all), an even count (temporal_patch_size frames per patch) within
    [min_frames, max_frames], spread evenly from the first frame to the last (qwen-vl-utils' rule)."""
    if total < 1:
        raise MediaError("the video has no frames")
    if video_fps <= 0:
        raise MediaError(f"the video's frame rate {video_fps} is not positive")
    factor = spec.temporal_patch_size
    if spec.video_frames is not None:
        n = max(factor, round(spec.video_frames / factor) * factor)
        if n > total:
            raise MediaError(f"processor.video.frames asks for {n} frames of a video that has {total}")
        return [int(i) for i in np.round(np.linspace(0, total - 1, n))]
    lo = math.ceil(spec.video_min_frames / factor) * factor
    hi = math.floor(min(spec.video_max_frames, total) / factor) * factor
    if hi < factor:
        return list(range(total))  # shorter than one temporal patch: every frame (padded later)
    n = math.floor(min(max(total / video_fps * spec.video_fps, lo), hi) / factor) * factor
    return [int(i) for i in np.round(np.linspace(0, total - 1, n))]


def expand_media_tokens(ids: Sequence[int], items: Sequence[Patches], image_token: int, video_token: int,
                        merge_size: int) -> list[int]:
    """The prompt's ids with each image/video placeholder token repeated once per token of its item (in order)."""
    queues = {"image": [p for p in items if p.kind == "image"], "video": [p for p in items if p.kind == "video"]}
    kinds = {image_token: "image", video_token: "video"}
    out: list[int] = []
    for token in ids:
        kind = kinds.get(token)
        if kind is None:
            out.append(token)
            continue
        if not queues[kind]:
            raise MediaError(f"the prompt has more {kind} placeholders than {kind}s given")
        out.extend([token] * queues[kind].pop(0).tokens(merge_size))
    left = {k: len(v) for k, v in queues.items() if v}
    if left:
        raise MediaError(f"the prompt has fewer placeholders than media given: {left} left over")
    return out
