"""Issue 37's static bars, kept: no Python module of service/ or backends/ over 400 lines, no C++ source or header
over 500, the engine's loop (engine/engine.py) at most 250. A module that outgrows them is split by what it does."""
from __future__ import annotations

from pathlib import Path

from tests.support.paths import REPO

LIMITS = {".py": 400, ".cc": 500, ".h": 500}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_over_its_size():
    over = [(str(p.relative_to(REPO)), n)
            for top in ("service", "backends") for p in sorted((REPO / top).rglob("*"))
            if p.suffix in LIMITS and p.is_file() and (n := _lines(p)) > LIMITS[p.suffix]]
    assert not over, f"over {LIMITS} lines: {over}"


def test_the_engine_loop_stays_short():
    assert _lines(REPO / "backends" / "mindspore" / "engine" / "engine.py") <= 250
