"""docs/api.md states the service's error taxonomy exactly: one row per status and ``error_type``."""
from __future__ import annotations

import re

from service import errors
from tests.support.paths import REPO

API_DOC = REPO / "docs" / "api.md"


def test_the_error_table_lists_every_status_and_error_type():
    text = API_DOC.read_text(encoding="utf-8")
    table = text[text.index("**Errors** come in three shapes"):text.index("- `/v1/completions` and")]
    rows = re.findall(r"^\s*\| (\d{3}) \| `([^`]+)` \|", table, re.M)
    taxonomy = {(cls.status, cls.error_type.value) for cls in errors.ServiceError.__subclasses__()}
    assert (415, "Unsupported Media Type") in taxonomy
    assert {(int(status), kind) for status, kind in rows} == taxonomy
