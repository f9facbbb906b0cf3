"""The layering of the import graph: ``service/`` never imports MindSpore,
``backends/`` never imports Tornado or ``service``, ``service/`` reaches the MindSpore backend only through
``backends/loader.py``, and no module of ``service/`` or ``backends/`` imports back into a circle, even under
``TYPE_CHECKING``."""
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


def test_service_reaches_the_mindspore_backend_only_through_the_loader() -> None:
    """``service/`` names ``backends.mindspore`` nowhere (TYPE_CHECKING and function-local imports included):
    the model, adapter and memory checks, the default model and the GGUF conversion go through
    ``backends/loader.py``."""
    reach = {module: sorted(n for n in names if n == "backends.mindspore" or n.startswith("backends.mindspore."))
             for module, names in package_modules("service").items()}
    assert not {m: n for m, n in reach.items() if n}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle among ``graph``'s modules (every import counts, TYPE_CHECKING ones too), or []."""
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
    return cycle


@pytest.mark.parametrize("package", ["service", "backends"])
def test_no_import_circle(package: str) -> None:
    cycle = find_cycle(package_modules(package))
    assert not cycle, " -> ".join(cycle)


def test_no_test_imports_a_test() -> None:
    """Shared helpers live in tests/support/ (STYLE 16): a test module imports no other test module."""
    reach = {module: sorted(n for n in names if n.split(".")[-1].startswith("test_") and n.startswith("tests."))
             for module, names in package_modules("tests").items()}
    assert not {m: n for m, n in reach.items() if n}
