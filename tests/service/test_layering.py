"""The layering of the import graph: ``service/`` never imports MindSpore,
``backends/`` never imports Tornado or ``service``, and no module of ``service/`` imports back into a
circle, even under ``TYPE_CHECKING``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute imports; ``from x import y`` gives ``x`` and ``x.y``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package: str) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted((REPO / package).rglob("*.py"))}


@pytest.mark.parametrize("package, forbidden", [
    ("service", ("mindspore",)),
    ("backends", ("tornado", "service")),
])
def test_layers_do_not_reach_across(package: str, forbidden: tuple[str, ...]) -> None:
    bad = {module: sorted(n for n in names if n.split(".")[0] in forbidden)
           for module, names in package_modules(package).items()}
    assert not {m: n for m, n in bad.items() if n}


def test_no_import_circle_in_service() -> None:
    graph = package_modules("service")
    edges = {m: {n for n in names if n in graph and n != m} for m, names in graph.items()}
    visiting, done, cycle = set(), set(), []

    def visit(node: str, path: list[str]) -> None:
        if node in done or cycle:
            return
        if node in visiting:
            cycle.extend(path[path.index(node):])
            return
        visiting.add(node)
        for nxt in sorted(edges[node]):
            visit(nxt, path + [nxt])
        visiting.discard(node)
        done.add(node)

    for start in sorted(edges):
        visit(start, [start])
    assert not cycle, " -> ".join(cycle)
