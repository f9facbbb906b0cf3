"""Request bodies read in chunks into one buffer: the ``Content-Type`` rule and the ``maxRequestLength`` cap.

Only the JSON routes use this. A body over the cap is refused as soon as that is known (from
``Content-Length``, or while a chunked body streams in), so it is never held in memory whole. A body within
it is held once: each chunk is copied into one ``bytearray`` and dropped (``BodyBuffer``).
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
    """A request body in one ``bytearray``: allocated whole at its declared ``Content-Length`` (``size_hint``),
    else grown chunk by chunk; never over ``limit``. Each chunk is copied in once and dropped; ``take`` hands
    the bytes over and forgets them, ``release`` drops them (a refused body)."""

    def __init__(self, limit: int, size_hint: int | None = None) -> None:
        self.limit = limit
        self.size = 0  # bytes arrived, kept or discarded
        self._data = bytearray(size_hint) if size_hint else bytearray()
        self._preallocated = bool(size_hint)

    def add(self, chunk: bytes) -> bool:
        """Keep ``chunk``; False (and nothing held any more) once the body is over ``limit``."""
        end = self.size + len(chunk)
        if end > self.limit:
            self.release()
            self.size = end
            return False
        if self._preallocated:
            self._data[self.size:end] = chunk
        else:
            self._data += chunk
        self.size = end
        return True

    @property
    def preallocated(self) -> bool:
        """Allocated whole at the declared length (counted then), rather than grown as chunks arrive."""
        return self._preallocated

    def discard(self, chunk: bytes) -> bool:
        """Count ``chunk`` without keeping it (a refused body still being read); False once over ``limit``."""
        self.size += len(chunk)
        return self.size <= self.limit

    def release(self) -> None:
        self._data, self._preallocated = bytearray(), False

    def take(self) -> bytearray:
        """The body; the buffer holds nothing afterwards, so the caller's reference is the only one."""
        data, self._data, self._preallocated = self._data, bytearray(), False
        del data[self.size:]  # a no-op unless the body ended short of its allocation
        return data
