"""deploy/haproxy: the affinity variant is haproxy.cfg plus the lines marked "affinity" (the prompt key and the
table that sticks it to a replica), so the balancing, checks, retries and drain tested on haproxy.cfg hold for
it too; both files pass HAProxy's own check where HAProxy is installed."""
from __future__ import annotations

import subprocess

import pytest

from tests.support.haproxy import CONFIGS, HAPROXY, MISSING


def settings(name: str) -> list[tuple[str, bool]]:
    """(setting, marked "affinity") for each configuration line of a file, comments and blank lines left out."""
    out = []
    for line in (CONFIGS / name).read_text().splitlines():
        setting = line.split("#", 1)[0].rstrip()
        if setting.strip():
            out.append((setting, line.rstrip().endswith("# affinity")))
    return out


def test_the_affinity_variant_is_the_recipe_plus_its_marked_lines():
    base, variant = settings("haproxy.cfg"), settings("haproxy-affinity.cfg")
    assert not any(marked for _, marked in base)
    unmarked = [setting for setting, marked in variant if not marked]
    assert unmarked == [setting for setting, _ in base]
    keywords = [setting.split()[0] for setting, marked in variant if marked]
    assert keywords == ["http-request"] * 3 + ["stick-table", "stick"]


@pytest.mark.skipif(HAPROXY is None, reason=MISSING)
@pytest.mark.parametrize("name", ["haproxy.cfg", "haproxy-affinity.cfg"])
def test_haproxy_accepts_the_file(name, tmp_path):
    env = {"MINDSERVE_LISTEN": "127.0.0.1:8080", "MINDSERVE_ADMIN_SOCKET": str(tmp_path / "s"),
           "MINDSERVE_R1": "127.0.0.1:1025", "MINDSERVE_R1_HEALTH": "1026",
           "MINDSERVE_R2": "127.0.0.1:2025", "MINDSERVE_R2_HEALTH": "2026"}
    check = subprocess.run([HAPROXY, "-c", "-f", str(CONFIGS / name)], env=env, capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
