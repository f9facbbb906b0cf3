"""A video file's frames at the sampling rate (PyAV): which frames (``sample_frame_indices``), decoded to
[H, W, 3] uint8 RGB, and the rate they represent (frames kept per second of video).

Bounded before anything is decoded: a frame may have at most ``MAX_FRAME_PIXELS`` (the header's size, then
each decoded frame's), and with ``max_patches`` the sampled frames at the processor's size must fit that
many vision patches. ``fit`` resizes each kept frame to that size as it is decoded (Pillow bicubic, as
``preprocess_video`` would), so a large video never holds its full-size frames."""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from backends.mindspore.families.qwen2_vl.config import ProcessorSpec
from backends.mindspore.families.qwen2_vl.preprocess import MediaError, sample_frame_indices, smart_resize

MAX_FRAME_PIXELS = 7680 * 4320  # an 8K UHD frame, as the media ingress's image bound


@dataclass(frozen=True, slots=True)
class SampledVideo:
    frames: np.ndarray  # [n, H, W, 3] uint8
    indices: tuple[int, ...]  # which decoded frames they are
    video_fps: float  # the file's frame rate
    sample_fps: float  # frames kept per second of video


def _open(source: str | Path | bytes):
    """A PyAV container on a file path or on a file's bytes (read from memory)."""
    import av

    return av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source))


def _name(source: str | Path | bytes) -> str:
    return "the video" if isinstance(source, bytes) else Path(source).name


def read_video(path: str | Path | bytes, spec: ProcessorSpec, *, max_patches: int | None = None,
               fit: bool = False) -> SampledVideo:
    """The sampled frames of the video at ``path`` (or of a video file's bytes); an unreadable file, a frame
    over ``MAX_FRAME_PIXELS`` or more than ``max_patches`` vision patches is a MediaError naming it."""
    import av

    total, rate, width, height = _probe(path)
    indices = sample_frame_indices(total, rate, spec)
    size = _checked_size(path, width, height, len(indices), spec, max_patches)
    wanted, frames = set(indices), []
    try:
        with _open(path) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:
                    _check_pixels(path, frame.width, frame.height)
                    frames.append(_fitted(frame.to_image(), size) if fit else frame.to_ndarray(format="rgb24"))
                if i >= indices[-1]:
                    break
    except av.error.FFmpegError as exc:
        raise MediaError(f"{_name(path)}: cannot decode the video: {exc}") from None
    if len(frames) != len(indices):
        raise MediaError(f"{_name(path)}: decoded {len(frames)} of the {len(indices)} sampled frames")
    return SampledVideo(np.stack(frames), tuple(indices), rate, len(indices) / total * rate)


def _check_pixels(path: str | Path | bytes, width: int, height: int) -> None:
    if width * height > MAX_FRAME_PIXELS:
        raise MediaError(f"{_name(path)}: frames of {width}x{height} = {width * height} pixels; a video frame may "
                         f"have at most {MAX_FRAME_PIXELS}")


def _checked_size(path: str | Path | bytes, width: int, height: int, frames: int, spec: ProcessorSpec,
                  max_patches: int | None) -> tuple[int, int] | None:
    """The processor's (height, width) for frames of the header's size (None if it gives none), checked
    against the pixel bound and ``max_patches``."""
    if not width or not height:
        return None
    _check_pixels(path, width, height)
    size = smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
    temporal = -(-frames // spec.temporal_patch_size)
    patches = temporal * (size[0] // spec.patch_size) * (size[1] // spec.patch_size)
    if max_patches is not None and patches > max_patches:
        raise MediaError(f"{_name(path)}: {frames} sampled frames of {size[1]}x{size[0]} make {patches} vision "
                         f"patches, more than the largest vision bucket {max_patches} (lower processor.video fps "
                         "or frames, or max_pixels)")
    return size


def _fitted(image: Image.Image, size: tuple[int, int] | None) -> np.ndarray:
    """A decoded frame at the processor's size (h, w) (Pillow bicubic), as uint8 RGB."""
    image = image.convert("RGB")
    if size is not None and image.size != (size[1], size[0]):
        image = image.resize((size[1], size[0]), resample=Image.Resampling.BICUBIC)
    return np.asarray(image, dtype=np.uint8)


def _probe(path: str | Path | bytes) -> tuple[int, float, int, int]:
    """(frame count, frames per second, width, height) of the first video stream; the count by demuxing if
    the header does not say."""
    import av

    try:
        with _open(path) as container:
            if not container.streams.video:
                raise MediaError(f"{_name(path)}: no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
    except av.error.FFmpegError as exc:
        raise MediaError(f"{_name(path)}: not a readable video: {exc}") from None
    if rate <= 0:
        raise MediaError(f"{_name(path)}: the video has no frame rate")
    return int(total), rate, width, height
