"""mindserve's top-level import names, ``service`` and ``backends``, are generic: another distribution that
installs a package of the same name into the same environment overwrites or mixes with ours, silently.
The command line refuses to start when one does (docs/installing.md says why and what to do instead).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import metadata

DISTRIBUTION = "mindserve"
IMPORT_NAMES = frozenset({"service", "backends"})


def import_name_conflict(distributions: Iterable[metadata.Distribution] | None = None) -> str | None:
    """A message naming the other distributions that install ``service`` or ``backends``; None if none does."""
    others: dict[str, list[str]] = {}
    for dist in metadata.distributions() if distributions is None else distributions:
        provided = _provided_names(dist)
        name = dist.metadata["Name"] if provided else None
        if name and _canonical(name) != DISTRIBUTION:
            for module in provided:
                others.setdefault(module, []).append(f"{name} {dist.version}")
    if not others:
        return None
    clashes = "; ".join(f"'{module}' also by {', '.join(sorted(set(names)))}"
                        for module, names in sorted(others.items()))
    return (f"the import names mindserve uses are also installed by other distributions ({clashes}): their "
            f"files and ours would overwrite each other. Install mindserve in its own virtual environment or "
            f"container (docs/installing.md)")


def _provided_names(dist: metadata.Distribution) -> set[str]:
    """Which of ``IMPORT_NAMES`` a distribution installs: from its top_level.txt, else from the first part
    of its RECORD paths (a plain text scan: parsing every RECORD of a large environment costs ~0.4 s)."""
    declared = dist.read_text("top_level.txt")
    if declared is not None:
        return IMPORT_NAMES.intersection(declared.split())
    record = dist.read_text("RECORD") or ""
    return {name for name in IMPORT_NAMES if re.search(rf"^{name}(?:/|\.py,)", record, re.MULTILINE)}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
