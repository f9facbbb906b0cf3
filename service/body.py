"""Request bodies: the ``Content-Type`` rule, the ``maxRequestLength`` cap, one buffer, one strict JSON parse.

Only the JSON routes use this. A body over the cap is refused as soon as that is known (from
``Content-Length``, or while a chunked body streams in), so it is never held in memory whole. A body within
it is held once: each chunk is copied into one ``bytearray`` and dropped (``BodyBuffer``). The whole body is
then parsed strictly (``parse_json_body``): one well-formed JSON document or a 400.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from service.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from service.validation import MAX_SHOWN_CHARS, show

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


# --- the body's JSON ---------------------------------------------------------------------------

MAX_JSON_DEPTH = 64  # nesting levels of arrays/objects; real requests use fewer than 10
_LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # only \\uD800-\\uDFFF escapes can leave one


_TOO_DEEP = f"request body JSON is rejected: nested deeper than {MAX_JSON_DEPTH} levels"
# Values and keys in one body: bounds the parsed tree (~100 bytes a value at most), whatever the body's shape
# (30 MB of "{}," would be 10 million dicts, 700 MB). /detokenize takes 2^20 ids.
MAX_JSON_VALUES = 1 << 21
# A JSON string, or the rest of the text from an unclosed quote: every quote starts a match, possessively, so
# stripping the strings is one linear pass whatever the text.
_STRING = re.compile(r'"(?:[^"\\]++|\\.?+)*+(?:"|\Z)', re.DOTALL)


class _JsonRejected(ValueError):
    """Raised by the parse hooks: the message is the whole client-facing reason."""


def decode_body(body: bytes | bytearray) -> str:
    """A request body's text; ``BadRequest`` when it is not UTF-8."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def parse_json_body(body: bytes | bytearray | str) -> Any:
    """Decode a request body strictly; anything but one well-formed JSON document → ``BadRequest``.

    Rejected: invalid UTF-8, NaN/Infinity, numbers that overflow a float, duplicate keys, nesting deeper
    than ``MAX_JSON_DEPTH``, and ``\\u`` escapes that leave a lone UTF-16 surrogate.
    """
    if not isinstance(body, str):
        body = decode_body(body)
    _check_value_count(body)
    try:
        value = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float,
                           parse_int=_float_range_int, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None
    except _JsonRejected as exc:
        raise BadRequest(f"request body JSON is rejected: {exc}") from None
    except ValueError as exc:  # JSONDecodeError
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    _check_tree(value, check_strings=_LONE_SURROGATE_ESCAPE.search(body) is not None)
    return value


def _check_value_count(text: str) -> None:
    """At most ``MAX_JSON_VALUES`` values, counted before the parse builds them: from the separators, with the
    strings' contents left out only when counting them in would pass the limit."""
    if _values_at_most(text) > MAX_JSON_VALUES and _values_at_most(_STRING.sub("", text)) > MAX_JSON_VALUES:
        raise BadRequest(f"request body JSON is rejected: more than {MAX_JSON_VALUES} values")


def _values_at_most(text: str) -> int:
    """Every value and key but the first follows one of ``[{,:`` (outside strings)."""
    return 1 + text.count("[") + text.count("{") + text.count(",") + text.count(":")


def _reject_constant(name: str) -> Any:
    raise _JsonRejected(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _JsonRejected(f"number {text[:MAX_SHOWN_CHARS]} is out of range")
    return value


def _float_range_int(text: str) -> int:
    """An integer literal; one a float cannot hold (over ~1.8e308) is out of range for every field."""
    if len(text.lstrip("-")) > 309:
        raise _JsonRejected(f"integer {text[:20]}… ({len(text.lstrip('-'))} digits) is out of range")
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise _JsonRejected(f"integer {text[:20]}… ({len(text.lstrip('-'))} digits) is out of range") from None
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _JsonRejected(f"duplicate key {show(key)} in one object")
            seen.add(key)
    return obj


def _check_tree(value: Any, *, check_strings: bool) -> None:
    """Depth limit (the validators recurse per level) and, if asked, no lone surrogates in strings."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items: Iterable[Any] = node.values()
            if check_strings:
                items = [*node.keys(), *node.values()]
        elif isinstance(node, list):
            items = node
        else:
            if check_strings and isinstance(node, str):
                _check_text(node)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise BadRequest(_TOO_DEEP)
        stack.extend((item, depth + 1) for item in items)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"request body JSON is rejected: an unpaired UTF-16 surrogate "
                         f"\\u{ord(text[exc.start]):04x} in a string") from None
