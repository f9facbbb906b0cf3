"""tests/data/schema_cases.json: request bodies and what the schemas and the server must say of each."""
from __future__ import annotations

import json
from typing import Any

from tests.support.paths import DATA_DIR

CASES_FILE = DATA_DIR / "schema_cases.json"


def expand(value: Any) -> Any:
    """Expand the data file's ``{"$repeat": X, "times": n}`` and ``{"$concat": [...]}`` shorthands."""
    if isinstance(value, dict) and "$repeat" in value:
        return expand(value["$repeat"]) * value["times"]
    if isinstance(value, dict) and "$concat" in value:
        return [item for part in value["$concat"] for item in expand(part)]
    if isinstance(value, dict):
        return {k: expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v) for v in value]
    return value


def load_cases() -> dict[str, Any]:
    doc = json.loads(CASES_FILE.read_text(encoding="utf-8"))
    for case in doc["cases"]:
        case["body"] = expand(case["body"])
    return doc
