"""Server-sent events framing: one ``data: <compact JSON>`` event per message, no [DONE] sentinel."""
from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any) -> str:
    """Compact JSON, UTF-8 text kept as is (the wire format of every body and event)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
