"""A list ``inputs`` → ``MediaRef``s: the part rules that need no I/O and no deployment setting (at most
``MAX_MEDIA_PARTS`` media parts, the URL length, which source a reference names, its declared type from
the extension or the data URL's media type). The part types a model accepts are checked by the dialect."""
from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

from service.media.errors import MediaRefused
from service.media.kinds import BARE_BASE64_MIME, BY_PART_TYPE, CANONICAL_MIME, MIME_OF_EXTENSION, TEXT_PART, Kind

MAX_MEDIA_PARTS = 20
MAX_URL_CHARS = 4096  # paths and http(s)/file URLs; inline data is bounded by the size caps instead
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_WHITESPACE = re.compile(r"\s+")
REMOTE_SCHEMES = ("http", "https")


class Source(enum.Enum):
    LOCAL = "local file"
    REMOTE = "http(s) URL"
    DATA = "data: URL"
    BASE64 = "base64 data"


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media part as the request names it; ``service/media/loader.py`` turns it into a ``MediaInput``."""

    kind: Kind
    source: Source
    url: str  # as sent
    field: str  # "inputs[2]"
    mime: str  # declared: from the extension or the data URL
    location: str  # LOCAL: the path; REMOTE: the URL; DATA/BASE64: the base64 payload, whitespace removed
    position: int = 0  # prompt characters before this part

    @property
    def inline(self) -> bool:
        return self.source in (Source.DATA, Source.BASE64)

    def refused(self, rule: str) -> MediaRefused:
        return MediaRefused(self.field, rule, self.url, inline=self.source is Source.BASE64)


def media_refs(parts: Sequence[tuple[str, str]]) -> tuple[MediaRef, ...]:
    """``parts``: each part's (type, value) in order, the value of a media part being its url. The media
    parts as ``MediaRef``s, each placed after the text before it; raises ``MediaRefused`` naming
    ``inputs[i]``."""
    refs: list[MediaRef] = []
    position = 0
    for index, (part_type, value) in enumerate(parts):
        if part_type == TEXT_PART:
            position += len(value)
            continue
        field = f"inputs[{index}]"
        if len(refs) == MAX_MEDIA_PARTS:
            raise MediaRefused(field, f"a request may have at most {MAX_MEDIA_PARTS} media parts; this is media "
                                      f"part {MAX_MEDIA_PARTS + 1}")
        refs.append(media_ref(BY_PART_TYPE[part_type], value, field, position))
    return tuple(refs)


def media_ref(kind: Kind, url: str, field: str, position: int = 0) -> MediaRef:
    """Which source ``url`` names, and its declared media type; refuses what no source accepts."""
    if url[:5].lower() == "data:":
        return _data_url(kind, url, field, position)
    scheme = _SCHEME.match(url)
    if scheme is None and PurePosixPath(url).suffix:
        return _local(kind, url, url, field, position)
    payload = _WHITESPACE.sub("", url)
    if scheme is None and kind.bare_base64 and len(payload) % 4 == 0 and _BASE64.fullmatch(payload):
        return MediaRef(kind, Source.BASE64, url, field, BARE_BASE64_MIME, payload, position)
    _check_length(url, field)
    name = scheme.group(1).lower() if scheme else None
    if name in REMOTE_SCHEMES:
        return _remote(kind, url, field, position)
    if name == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaRefused(field, f"a file: URL must name a file on this server, not on host {parts.netloc}", url)
        return _local(kind, unquote(parts.path), url, field, position)
    sources = "a local path, a file:, http(s): or data: URL" + (", or bare base64" if kind.bare_base64 else "")
    if name is not None:
        raise MediaRefused(field, f"scheme {name}: is not supported (send {sources})", url)
    raise MediaRefused(field, f"has no {kind.name} extension ({', '.join(kind.extensions)}) and is not "
                              f"{sources}", url)


def _remote(kind: Kind, url: str, field: str, position: int) -> MediaRef:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise MediaRefused(field, f"is not a valid URL: {exc}", url) from None
    if not parts.hostname:
        raise MediaRefused(field, "an http(s) URL needs a host", url)
    if not parts.hostname.isascii():
        raise MediaRefused(field, "the host of a media URL must be ASCII (an international name in its xn-- form)",
                           url)
    if parts.username is not None or parts.password is not None:
        raise MediaRefused(field, "an http(s) URL must not carry credentials (user@host)", url)
    return MediaRef(kind, Source.REMOTE, url, field, _mime(kind, unquote(parts.path), url, field), url, position)


def _local(kind: Kind, path: str, url: str, field: str, position: int) -> MediaRef:
    _check_length(url, field)
    if "\x00" in path:
        raise MediaRefused(field, "a media path must not contain a NUL character", url)
    if ".." in PurePosixPath(path).parts:
        raise MediaRefused(field, "a media path must not contain '..'", url)
    return MediaRef(kind, Source.LOCAL, url, field, _mime(kind, path, url, field), path, position)


def _mime(kind: Kind, path: str, url: str, field: str) -> str:
    suffix = PurePosixPath(path).suffix.lower()
    if suffix not in kind.extensions:
        got = f"extension {suffix}" if suffix else "no extension"
        raise MediaRefused(field, f"{kind.part_type} needs one of the {kind.name} extensions "
                                  f"{', '.join(kind.extensions)}; got {got}", url)
    return MIME_OF_EXTENSION[suffix]


def _data_url(kind: Kind, url: str, field: str, position: int) -> MediaRef:
    header, comma, payload = url[len("data:"):].partition(",")
    mime, *params = (p.strip() for p in header.split(";"))
    if not comma or "base64" not in (p.lower() for p in params):
        raise MediaRefused(field, "a data: URL must be base64 (data:<media type>;base64,<data>)", url)
    mime = mime.lower()
    if mime not in kind.mime_types:
        raise MediaRefused(field, f"a data: URL in {kind.part_type} needs one of the {kind.name} media types "
                                  f"{', '.join(kind.mime_types)}; got {mime or 'none'}", url)
    return MediaRef(kind, Source.DATA, url, field, CANONICAL_MIME.get(mime, mime), _WHITESPACE.sub("", payload),
                    position)


def _check_length(url: str, field: str) -> None:
    if len(url) > MAX_URL_CHARS:
        raise MediaRefused(field, f"a media path or URL must be at most {MAX_URL_CHARS} characters, "
                                  f"got {len(url)}", url)
