"""Server-sent events framing: one ``data: <compact JSON>`` event per message, no [DONE] sentinel."""
from __future__ import annotations

from typing import Any

from service.jsonio import dumps


def event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
