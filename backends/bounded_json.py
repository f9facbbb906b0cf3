"""JSON from untrusted files, parsed within bounds: the nesting depth is checked on the raw bytes before
the parser sees them, so a hostile "[[[[..." costs a scan, not the parser's recursion (whose depth follows
whatever recursion limit the process has)."""

from __future__ import annotations

import json
import re
from typing import Any

# A string (skipped whole; the unrolled form keeps the regex engine from saving state per character) or a
# bracket (group 1).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|([\[\]{}])')


def loads(raw: bytes, *, max_depth: int, unique_keys: bool = False) -> Any:
    """Parse UTF-8 JSON ``raw``; ValueError (with the reason) when it is not JSON, nests deeper than
    ``max_depth`` arrays/objects, or (``unique_keys``) repeats a key in an object."""
    depth = 0
    for token in _TOKEN.finditer(raw):  # one match at a time: no copy of raw
        text = token[1]
        if text is None:
            continue
        if text in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise ValueError(f"nested deeper than {max_depth} levels")
        else:
            depth -= 1
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique if unique_keys else None)
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out
