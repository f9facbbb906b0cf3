"""Request bodies read in chunks: the ``Content-Type`` rule and the ``maxRequestLength`` cap.

Only the JSON routes use this. A body over the cap is refused as soon as that is known (from
``Content-Length``, or while a chunked body streams in), so it is never held in memory whole.
"""
from __future__ import annotations

from collections.abc import Mapping

from service.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

JSON_MEDIA_TYPE = "application/json"


def check_content_type(header: str | None) -> None:
    """No ``Content-Type``, ``application/json`` or any ``+json`` type, in UTF-8; else 415."""
    if header is None or not header.strip():
        return
    media_type, _, rest = header.partition(";")
    media_type = media_type.strip().lower()
    if media_type != JSON_MEDIA_TYPE and not (media_type.startswith("application/") and media_type.endswith("+json")):
        raise UnsupportedMediaType(f"Content-Type {header.strip()[:100]!r} is not supported: send the body as "
                                   f"{JSON_MEDIA_TYPE} (curl: -H 'Content-Type: {JSON_MEDIA_TYPE}')")
    for param in rest.split(";"):
        name, _, value = param.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise UnsupportedMediaType(f"Content-Type charset {charset[:40]!r} is not supported: JSON bodies "
                                       "must be UTF-8")


def declared_length(headers: Mapping[str, str], limit: int) -> int | None:
    """The ``Content-Length`` (None when the body is chunked or absent); 413 when over ``limit``."""
    raw = headers.get("Content-Length")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise BadRequest(f"Content-Length {raw[:40]!r} is not a byte count")
    length = int(raw)
    if length > limit:
        raise too_large(length, limit)
    return length


def too_large(size: int, limit: int, *, at_least: bool = False) -> PayloadTooLarge:
    what = f"more than {size}" if at_least else f"{size}"
    return PayloadTooLarge(f"request body of {what} bytes is over maxRequestLength ({limit} bytes)")


class BodyBuffer:
    """Collects a body's chunks up to ``limit`` bytes; ``add`` returns False once it is over."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._chunks: list[bytes] = []

    def add(self, chunk: bytes) -> bool:
        self.size += len(chunk)
        if self.size > self.limit:
            self._chunks.clear()
            return False
        self._chunks.append(chunk)
        return True

    def discard(self, chunk: bytes) -> None:
        self.size += len(chunk)

    def getvalue(self) -> bytes:
        return b"".join(self._chunks)
