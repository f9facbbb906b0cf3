"""Media refusals in the service's error taxonomy: each names the part (``inputs[i]``), the rule and the
value (a path or URL, cut; inline data by its media type and length only, never a file's content)."""
from __future__ import annotations

from service.errors import PayloadTooLarge, TooManyRequests, ValidationError
from service.validation import show

INLINE_HEADER_SHOWN = 40  # characters of a data: URL's header shown; its payload never is


def shown(url: str, inline: bool = False) -> str:
    """How a media reference appears in a message: a path or URL as JSON (cut); a data: URL by its header
    and length; bare base64 (``inline``) by its length."""
    if url[:5].lower() == "data:":
        header = url.split(",", 1)[0][:INLINE_HEADER_SHOWN]
        return f'"{header},…" ({len(url)} characters)'
    if inline:
        return f"base64 data ({len(url)} characters)"
    return show(url)


def _message(field: str, rule: str, url: str | None, inline: bool) -> str:
    return f"{field}: {rule}" if url is None else f"{field} {shown(url, inline)}: {rule}"


class MediaRefused(ValidationError):
    """A part breaks a rule (its shape, source, type, or content): 422."""

    def __init__(self, field: str, rule: str, url: str | None = None, *, inline: bool = False) -> None:
        super().__init__(_message(field, rule, url, inline))
        self.field, self.rule = field, rule


class DownloadFailed(MediaRefused):
    """A remote part could not be fetched: names the host and the reason (422)."""

    def __init__(self, field: str, url: str, host: str, reason: str) -> None:
        super().__init__(field, f"download from host {host} failed: {reason}", url)
        self.host, self.reason = host, reason


class MediaTooLarge(PayloadTooLarge):
    """A part, or a request's media in all, over its cap: 413."""

    def __init__(self, field: str, rule: str, url: str | None = None, *, inline: bool = False) -> None:
        super().__init__(_message(field, rule, url, inline))
        self.field, self.rule = field, rule


class MediaBusy(TooManyRequests):
    """The server is loading or holding as much media as it may: 429 at once, not a wait of unknown
    length."""


class OverLimit(Exception):
    """Internal: a body passed the byte limit it was read under (``size``: the bytes seen or declared);
    ``service/media/loader.py`` turns it into the ``MediaTooLarge`` of the limit that applied."""

    def __init__(self, size: int, declared: bool = False) -> None:
        super().__init__(size)
        self.size, self.declared = size, declared
