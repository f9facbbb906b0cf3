"""The wire form of every JSON body and event: compact, UTF-8 text kept as is, no NaN or Infinity."""
from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
