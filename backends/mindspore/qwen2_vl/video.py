"""A video file's frames at the sampling rate (PyAV): which frames (``sample_frame_indices``), decoded to
[H, W, 3] uint8 RGB, and the rate they represent (frames kept per second of video)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.mindspore.qwen2_vl.config import ProcessorSpec
from backends.mindspore.qwen2_vl.preprocess import MediaError, sample_frame_indices


@dataclass(frozen=True, slots=True)
class SampledVideo:
    frames: np.ndarray  # [n, H, W, 3] uint8
    indices: tuple[int, ...]  # which decoded frames they are
    video_fps: float  # the file's frame rate
    sample_fps: float  # frames kept per second of video


def read_video(path: str | Path, spec: ProcessorSpec) -> SampledVideo:
    """The sampled frames of the video at ``path``; an unreadable file is a MediaError naming it."""
    import av

    total, rate = _probe(path)
    indices = sample_frame_indices(total, rate, spec)
    wanted, frames = set(indices), []
    try:
        with av.open(str(path)) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if i >= indices[-1]:
                    break
    except av.error.FFmpegError as exc:
        raise MediaError(f"{Path(path).name}: cannot decode the video: {exc}") from None
    if len(frames) != len(indices):
        raise MediaError(f"{Path(path).name}: decoded {len(frames)} of the {len(indices)} sampled frames")
    return SampledVideo(np.stack(frames), tuple(indices), rate, len(indices) / total * rate)


def _probe(path: str | Path) -> tuple[int, float]:
    """(frame count, frames per second) of the first video stream; counted by demuxing if the header
    does not say."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(f"{Path(path).name}: no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
    except av.error.FFmpegError as exc:
        raise MediaError(f"{Path(path).name}: not a readable video: {exc}") from None
    if rate <= 0:
        raise MediaError(f"{Path(path).name}: the video has no frame rate")
    return int(total), rate
