"""Deterministic test media for the Qwen2-VL tests: three images of different sizes (gradients and shapes,
drawn with Pillow; committed as PNGs in tests/data/ by make_qwen2_vl_goldens.py), the frames of a short
clip, and video files of them (PyAV): a lossless H.264 mp4, so a decoded frame is byte-equal to the one
drawn, or any container/codec.

The three sizes take the three branches of the reference's smart_resize under the tiny checkpoint's
pixel bounds (3136..50176): A (300x220) is scaled down to fit max_pixels, B (123x77) only rounds to
multiples of 28, C (40x30) is scaled up to min_pixels.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZES = {"a": (300, 220), "b": (123, 77), "c": (40, 30)}  # (width, height)
VIDEO_SIZE = (112, 84)  # (width, height): multiples of 28, inside the pixel bounds
VIDEO_FRAMES, VIDEO_FPS = 8, 4  # a 2 s clip; sampled at 2 fps -> 4 frames
IMAGE_FILES = {k: f"qwen2_vl_image_{k}.png" for k in IMAGE_SIZES}


def draw_image(key: str) -> Image.Image:
    """Image ``key`` (a, b or c): an RGB gradient with an ellipse, a rectangle and a line on it."""
    width, height = IMAGE_SIZES[key]
    seed = ord(key)
    x = np.linspace(0.0, 1.0, width)[None, :]
    y = np.linspace(0.0, 1.0, height)[:, None]
    rgb = np.stack([255 * x * np.ones_like(y), 255 * y * np.ones_like(x), 128 + 100 * np.sin(6.0 * (x + y) + seed)],
                   axis=-1)
    img = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    draw.ellipse((width * 0.1, height * 0.15, width * 0.55, height * 0.7), fill=(240, 200, 30), outline=(0, 0, 0))
    draw.rectangle((width * 0.5, height * 0.45, width * 0.9, height * 0.9), fill=(30, 60, 200))
    draw.line((0, height - 1, width - 1, 0), fill=(255, 255, 255), width=max(1, width // 40))
    return img


def write_images(directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, name in IMAGE_FILES.items():
        out[key] = directory / name
        draw_image(key).save(out[key], format="PNG", optimize=True)
    return out


def video_frames() -> np.ndarray:
    """The clip's frames [VIDEO_FRAMES, H, W, 3] uint8: a square moving right over a shifting gradient."""
    width, height = VIDEO_SIZE
    frames = []
    for t in range(VIDEO_FRAMES):
        x = np.linspace(0.0, 1.0, width)[None, :]
        y = np.linspace(0.0, 1.0, height)[:, None]
        base = np.stack([255 * ((x + 0.1 * t) % 1.0) * np.ones_like(y), 200 * y * np.ones_like(x),
                         np.full((height, width), 60.0 + 20 * t)], axis=-1)
        frame = np.clip(base, 0, 255).astype(np.uint8)
        left, top = 8 + 10 * t, 20 + 3 * t
        frame[top:top + 24, left:left + 24] = (250, 40 + 25 * t, 40)
        frames.append(frame)
    return np.stack(frames)


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> Path:
    """A lossless H.264 (libx264rgb, crf 0) mp4 of ``frames`` at ``fps``."""
    return write_video(path, frames, fps, "mp4", "libx264rgb", "rgb24", {"crf": "0", "preset": "ultrafast"})


def write_video(path: Path, frames: np.ndarray, fps: int, container: str, codec: str, pix_fmt: str = "yuv420p",
                options: dict[str, str] | None = None) -> Path:
    """``frames`` encoded with ``codec`` in ``container`` (PyAV): e.g. mp4/libx264, avi/mpeg4, asf/wmv2."""
    import av

    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps, options=options or {})
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path
