"""The vision tower as the engine runs it (the family's vision part, ``families.VisionPart``): one image or
video's patches -> its language-model rows, on a fixed set of compiled graphs (compiled at warm-up, none after);
and a request's prompt with its media (``request.py``).

One graph per patch bucket (``VISION_BUCKETS`` up to the one holding the largest image ``max_pixels``
allows). Qwen2.5-VL's window blocks take a window layout whose shape is fixed per bucket: ``bucket / merge^2``
windows (the most a grid of that many patches can have: one merged unit each), the windows a grid does not
use all padding. So the window count never selects a graph; the pipeline's power-of-two window buckets
(``pipeline.Qwen2VL``) give the same rows.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import mindspore as ms

from backends.mindspore.families.qwen2_vl.config import VLSpec, processor_chat_template, vision_buckets
from backends.mindspore.families.qwen2_vl.positions import (WindowLayout, frame_ids, segment_mask, vision_cos_sin,
                                                            window_ids, window_layout)
from backends.mindspore.families.qwen2_vl.preprocess import Patches
from backends.mindspore.families.qwen2_vl.request import VisionPrompt, served_prompt
from backends.mindspore.families.qwen2_vl.vision import VisionTower
from backends.mindspore.families.qwen2_vl.weights import load_vl_weights
from backends.mindspore.modeldir.spec import ModelSpec
from backends.types import MediaInput

log = logging.getLogger("mindserve.engine")


class VisionEncoder:
    """The tower's cell and its bucketed calls; ``compiled`` the graph keys called so far."""

    def __init__(self, spec: VLSpec, weights: dict[str, np.ndarray]) -> None:
        self.spec = spec
        self.buckets = vision_buckets(spec)
        self.tower = VisionTower(spec.vision, weights)
        self.tower.set_train(False)
        self.compiled: set[tuple] = set()

    @staticmethod
    def read_weights(spec: ModelSpec) -> dict[str, np.ndarray]:
        """The checkpoint's arrays, checked name by name against both towers (``weights.load_vl_weights``)."""
        return load_vl_weights(spec.vision)

    @staticmethod
    def chat_template(model_dir: Path) -> str:
        """The released checkpoints' processor template (``config.processor_chat_template``)."""
        return processor_chat_template(model_dir)

    @property
    def max_patches(self) -> int:
        return self.buckets[-1]

    def prompt(self, text: str, media: Sequence[MediaInput], encode: Callable[[str], list[int]],
               kept: Callable[[int], tuple[int, int]], max_seq_len: int, max_window: int
               ) -> tuple[VisionPrompt | None, list[Patches]]:
        """A request's prompt with its media, within the largest bucket (``request.served_prompt``)."""
        return served_prompt(text, media, self.spec, encode, self.max_patches, kept, max_seq_len, max_window)

    def bucket_for(self, patches: int) -> int | None:
        return next((b for b in self.buckets if b >= patches), None)

    def layout(self, item: Patches, bucket: int) -> WindowLayout:
        """The window layout of ``item`` at its bucket's fixed shape; a one-slot placeholder without windows."""
        v = self.spec.vision
        if not v.window_size:
            return window_layout(np.zeros(1, np.int64), bucket, 1, 1)
        segments = window_ids(item.grid, v.merge_size, v.window_units)
        return window_layout(segments, bucket, (v.window_units * v.merge_size) ** 2, bucket // v.merge_size ** 2)

    def encode_reached(self, prefill, fail) -> list:
        """Encode each media item the planned prompt chunks ``prefill`` ((sequence, tokens) pairs) reach and
        no earlier step encoded (an item the prefix cache holds is never reached); a sequence whose item
        fails is handed to ``fail(seq, exc)`` and returned, to leave the plan."""
        failed = []
        for seq, n in prefill:
            try:
                for i in seq.unencoded(seq.prefilled, seq.prefilled + n):
                    seq.media_rows[i] = self.encode(seq.media[i])
            except Exception as exc:
                failed.append(seq)
                fail(seq, exc)
        return failed

    def encode(self, item: Patches) -> np.ndarray:
        """The rows [tokens, out_dim] of one image or video."""
        v = self.spec.vision
        n = len(item.pixel_values)
        bucket = self.bucket_for(n)
        if bucket is None:
            raise ValueError(f"the {item.kind} has {n} patches, more than the largest vision bucket {self.max_patches}")
        patches = np.zeros((bucket, v.patch_dim), np.float32)
        patches[:n] = item.pixel_values
        cos = np.zeros((bucket, v.head_dim), np.float32)
        sin = np.zeros((bucket, v.head_dim), np.float32)
        cos[:n], sin[:n] = vision_cos_sin(item.grid, v.merge_size, v.head_dim, v.rope_theta)
        layout = self.layout(item, bucket)
        started = time.perf_counter()
        out = self.tower(*(ms.Tensor(a) for a in (patches, cos, sin, segment_mask(frame_ids(item.grid), bucket),
                                                     layout.index, layout.inverse, layout.key_mask))).asnumpy()
        key = ("vision", bucket)
        if key not in self.compiled:
            self.compiled.add(key)
            log.info("compiled graph %s in %.2fs", key, time.perf_counter() - started)
        return out[: item.tokens(v.merge_size)]

    def warmup_plan(self) -> list[tuple]:
        return [("vision", b) for b in self.buckets]

    def warmup(self) -> None:
        """Compile every bucket's graph."""
        started = time.perf_counter()
        for key in self.warmup_plan():
            self.warm(key)
        log.info("vision warm-up done: %d graphs in %.1fs", len(self.buckets), time.perf_counter() - started)

    def warm(self, key: tuple) -> None:
        """Call the graph of ``key`` once on a one-frame grid that selects it."""
        m = self.spec.vision.merge_size
        bucket = key[1]
        smaller = [b for b in self.buckets if b < bucket]
        units = (smaller[-1] // (m * m) + 1) if smaller else 1  # one unit more than the next smaller bucket
        grid = (1, m, m * units)
        pixels = np.zeros((units * m * m, self.spec.vision.patch_dim), np.float32)
        self.encode(Patches(pixels, grid, "image"))
