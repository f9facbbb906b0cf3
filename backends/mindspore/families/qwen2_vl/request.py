"""A served request's prompt for Qwen2-VL: the prompt text and its media parts (``MediaInput``, bytes as the
service fetched them) -> the expanded ids, M-RoPE positions, delta and each item's token span and digest.

Each media part becomes the chat template's vision tokens (``<|vision_start|><|image_pad|><|vision_end|>``,
``<|video_pad|>`` for a video) inserted at its ``position`` in the text, the pad repeated once per merged
patch group. The digest (SHA-256 of the kind and the file's bytes: the same bytes preprocess to the same
patches) is what the prefix cache mixes into the blocks an item's tokens occupy, since every image's pad
ids are equal. Errors are ``MediaError`` naming the part (``inputs`` media part n, its source).
"""
from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from backends.mindspore.families.qwen2_vl.config import VLSpec
from backends.mindspore.families.qwen2_vl.positions import rope_index
from backends.mindspore.families.qwen2_vl.preprocess import (MediaError, Patches, expand_media_tokens, preprocess_image,
                                                             preprocess_video)
from backends.mindspore.families.qwen2_vl.video import read_video
from backends.errors import InputRejected
from backends.types import MediaInput

PAD_TOKENS = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """Where one media item's pad tokens sit in the expanded prompt, and what it is."""

    kind: str
    start: int
    end: int  # exclusive
    digest: bytes


@dataclass(frozen=True, slots=True)
class VisionPrompt:
    """The expanded prompt of a request with media (or vision tokens)."""

    ids: tuple[int, ...]
    positions: np.ndarray  # [3, L] int32
    delta: int  # decode position = cache index + delta
    spans: tuple[MediaSpan, ...]


def insert_vision_tokens(text: str, media: Sequence[MediaInput]) -> str:
    """``text`` with each part's vision tokens at its position (positions count characters of ``text``)."""
    out, at = [], 0
    for part in sorted(media, key=lambda m: m.position):
        pos = min(max(part.position, at), len(text))
        out.append(text[at:pos])
        out.append(VISION_START + PAD_TOKENS[part.kind] + VISION_END)
        at = pos
    out.append(text[at:])
    return "".join(out)


def _label(i: int, part: MediaInput) -> str:
    return f"inputs media part {i} ({part.kind} from {part.source})"


def preprocess_part(i: int, part: MediaInput, spec: VLSpec, max_patches: int | None = None) -> Patches:
    """One part's patches (Pillow / PyAV on the bytes; a video of more than ``max_patches`` patches refused
    before its frames are decoded); MediaError naming the part."""
    try:
        if part.kind == "image":
            with Image.open(io.BytesIO(part.data)) as image:
                image.load()
                return preprocess_image(image, spec.processor)
        if part.kind == "video":
            clip = read_video(part.data, spec.processor, max_patches=max_patches, fit=True)
            return preprocess_video(clip.frames, spec.processor, fps=clip.sample_fps)
    except MediaError as exc:
        raise MediaError(f"{_label(i, part)}: {exc}") from None
    except Exception as exc:  # Pillow and PyAV raise what they like on hostile bytes: never past this point
        raise MediaError(f"{_label(i, part)}: cannot be read as an {part.kind}: {type(exc).__name__}: {exc}") from None
    raise MediaError(f"{_label(i, part)}: this model takes image and video parts, not {part.kind}")


def vision_prompt(ids: Sequence[int], items: Sequence[Patches], digests: Sequence[bytes],
                  spec: VLSpec) -> VisionPrompt:
    """The expanded ids of tokenized ``ids`` (one pad token per item, in order), their M-RoPE positions, the
    delta and each item's span."""
    merge = spec.vision.merge_size
    expanded = expand_media_tokens(ids, items, spec.image_token_id, spec.video_token_id, merge)
    positions, delta = rope_index(expanded, items, spec.image_token_id, spec.video_token_id, merge,
                                  spec.vision.tokens_per_second, timed_video=spec.family == "qwen2_5_vl")
    spans, at = [], 0
    pads = {spec.image_token_id, spec.video_token_id}
    arr = np.asarray(expanded)
    for item, digest in zip(items, digests):
        start = at + int(np.flatnonzero(np.isin(arr[at:], list(pads)))[0])
        n = item.tokens(merge)
        spans.append(MediaSpan(item.kind, start, start + n, digest))
        at = start + n
    return VisionPrompt(tuple(expanded), positions.astype(np.int32), delta, tuple(spans))


def media_digest(part: MediaInput) -> bytes:
    return hashlib.sha256(part.kind.encode() + b"\0" + part.data).digest()


def build_prompt(text: str, media: Sequence[MediaInput], spec: VLSpec, encode: Callable[[str], list[int]],
                 max_patches: int | None = None) -> tuple[VisionPrompt, list[Patches]]:
    """Text + media parts -> the expanded prompt and each item's patches (in prompt order); an item of more
    than ``max_patches`` patches is a MediaError."""
    ordered = sorted(media, key=lambda m: m.position)
    items = [preprocess_part(i, part, spec, max_patches) for i, part in enumerate(ordered)]
    for i, item in enumerate(items):
        if max_patches is not None and len(item.pixel_values) > max_patches:
            raise MediaError(f"{_label(i, ordered[i])}: the {item.kind} has {len(item.pixel_values)} patches, more "
                             f"than the largest vision bucket {max_patches} (lower processor max_pixels)")
    ids = encode(insert_vision_tokens(text, ordered))
    return vision_prompt(ids, items, [media_digest(p) for p in ordered], spec), items


def truncate_prompt(prompt: VisionPrompt, items: Sequence[Patches], start: int, end: int,
                    spec: VLSpec) -> tuple[VisionPrompt, list[Patches]]:
    """The prompt cut to tokens [start, end) (positions recomputed from the kept ids); MediaError if the cut
    goes through or drops a media item (a model cannot see part of an image)."""
    for i, span in enumerate(prompt.spans):
        if span.start < start or span.end > end:
            raise MediaError(f"inputs media part {i} ({span.kind}, prompt tokens {span.start}..{span.end}) would "
                             f"be cut by truncation to tokens {start}..{end}")
    ids = prompt.ids[start:end]
    merge = spec.vision.merge_size
    positions, delta = rope_index(ids, items, spec.image_token_id, spec.video_token_id, merge,
                                  spec.vision.tokens_per_second, timed_video=spec.family == "qwen2_5_vl")
    spans = tuple(MediaSpan(s.kind, s.start - start, s.end - start, s.digest) for s in prompt.spans)
    return VisionPrompt(ids, positions.astype(np.int32), delta, spans), list(items)


def served_prompt(text: str, media: Sequence[MediaInput], spec: VLSpec, encode: Callable[[str], list[int]],
                  max_patches: int, kept: Callable[[int], tuple[int, int]], max_seq_len: int, max_window: int
                  ) -> tuple[VisionPrompt | None, list[Patches]]:
    """A request's prompt: the media preprocessed, the vision tokens expanded, then cut to the tokens ``kept(n)``
    keeps of n (the engine's limits; never through an image); (None, []) for a prompt without media.
    InputRejected for media the preprocessing cannot take, or M-RoPE positions past ``max_window`` (a sequence
    grows to ``max_seq_len`` tokens)."""
    try:
        prompt, items = build_prompt(text, media, spec, encode, max_patches)
        start, end = kept(len(prompt.ids))
        if (start, end) != (0, len(prompt.ids)):
            prompt, items = truncate_prompt(prompt, items, start, end, spec)
    except MediaError as exc:
        raise InputRejected(str(exc)) from None
    longest = int(prompt.positions.max(initial=0)) + 1, max_seq_len + prompt.delta
    if max(longest) > max_window:
        raise InputRejected(f"inputs reaches M-RoPE position {max(longest) - 1}, past the model's "
                            f"{max_window} positions")
    return (prompt, items) if prompt.spans else (None, [])
