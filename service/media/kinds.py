"""The media kinds: which part type carries which kind, and the file extensions and data-URL media types
each kind may have (the reference server's lists, plus common aliases of the same types)."""
from __future__ import annotations

from dataclasses import dataclass

TEXT_PART = "text"


@dataclass(frozen=True, slots=True)
class Kind:
    name: str  # "image" | "video" | "audio": ``backends.types.MediaInput.kind``
    part_type: str  # the part's ``type`` on the wire
    extensions: tuple[str, ...]  # lower-case, with the dot
    mime_types: tuple[str, ...]  # accepted in a data: URL
    bare_base64: bool  # whether a bare base64 string is accepted (images only, read as JPEG)


KINDS: tuple[Kind, ...] = (
    Kind("image", "image_url", (".jpg", ".jpeg", ".png"), ("image/jpeg", "image/png", "image/jpg"), True),
    Kind("video", "video_url", (".mp4", ".avi", ".wmv"), ("video/mp4", "video/x-msvideo", "video/x-ms-wmv"), False),
    Kind("audio", "audio_url", (".mp3", ".wav", ".flac"),
         ("audio/mpeg", "audio/x-wav", "audio/wav", "audio/flac", "audio/x-flac", "audio/mp3"), False),
)
BY_PART_TYPE = {kind.part_type: kind for kind in KINDS}
BY_NAME = {kind.name: kind for kind in KINDS}

# The media type a file with this extension, or a data: URL with an alias, is declared as.
MIME_OF_EXTENSION = {
    ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png",
    ".mp4": "video/mp4", ".avi": "video/x-msvideo", ".wmv": "video/x-ms-wmv",
    ".mp3": "audio/mpeg", ".wav": "audio/wav", ".flac": "audio/flac",
}
CANONICAL_MIME = {"image/jpg": "image/jpeg", "audio/x-wav": "audio/wav", "audio/x-flac": "audio/flac",
                  "audio/mp3": "audio/mpeg"}
BARE_BASE64_MIME = "image/jpeg"  # the reference server reads bare base64 as a JPEG


def part_types(kinds: frozenset[str]) -> list[str]:
    """The part types a model with these media kinds accepts, text first (what /info lists)."""
    return [TEXT_PART, *(kind.part_type for kind in KINDS if kind.name in kinds)]
