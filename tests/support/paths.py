"""Where things are, for the tests."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
GOLDEN_DIR = TESTS / "golden"
DATA_DIR = TESTS / "data"
