"""The house style's mechanical part: ruff with the repository's configuration ([tool.ruff] in
pyproject.toml: 120 columns, blank lines, unused names) over the shipped code, the tests and bench/."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from tests.support.paths import REPO


def _ruff() -> list[str] | None:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed: pip install -e '.[test]'")
def test_ruff_passes_with_the_repository_configuration():
    out = subprocess.run([*_ruff(), "check", "--no-cache", "backends", "service", "tests", "bench"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
