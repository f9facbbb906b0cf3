"""The golden Qwen2-VL prompts as a served request sends them: the prompt text without the vision tokens, and
each media part (the file's bytes) at the character position its tokens had in the golden chat string."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from backends.types import MediaInput
from tests.support.scripts.make_qwen2_vl_goldens import PROMPTS
from tests.support.paths import DATA_DIR, GOLDEN_DIR
from tests.support.vlm_media import IMAGE_FILES, VIDEO_FPS, video_frames, write_mp4

TRIPLES = {"<|vision_start|><|image_pad|><|vision_end|>": "image",
           "<|vision_start|><|video_pad|><|vision_end|>": "video"}


@cache
def golden(arch: str) -> dict:
    return json.loads((GOLDEN_DIR / f"qwen2_vl_{arch}.json").read_text(encoding="utf-8"))


@dataclass(frozen=True)
class GoldenRequest:
    text: str  # the chat string with the vision tokens taken out
    parts: tuple[tuple[str, int, Path], ...]  # (kind, character position, file)

    def media(self) -> tuple[MediaInput, ...]:
        return tuple(MediaInput(kind, path.read_bytes(), "image/png" if kind == "image" else "video/mp4", str(path),
                                position) for kind, position, path in self.parts)


def golden_request(arch: str, prompt: str, video_path: Path) -> GoldenRequest:
    """``prompt`` (one_image, two_images, video) of ``arch``'s goldens: text and parts in order."""
    chat = golden(arch)["prompts"][prompt]["chat"]
    files = [DATA_DIR / IMAGE_FILES[k] for k in PROMPTS[prompt][0].get("images", [])]
    text, parts = "", []
    while True:
        hits = [(chat.find(t), t) for t in TRIPLES if t in chat]
        if not hits:
            return GoldenRequest(text + chat, tuple(parts))
        at, triple = min(hits)
        text += chat[:at]
        kind = TRIPLES[triple]
        parts.append((kind, len(text), files.pop(0) if kind == "image" else video_path))
        chat = chat[at + len(triple):]


def write_golden_clip(path: Path) -> Path:
    """The golden clip as the lossless H.264 mp4 the goldens were sampled from."""
    return write_mp4(path, video_frames(), VIDEO_FPS)
