"""The layering of the import graph: ``service/`` never imports MindSpore,
``backends/`` never imports Tornado or ``service``, ``service/`` reaches the MindSpore backend only through
``backends/loader.py``, no module of ``service/`` or ``backends/`` imports back into a circle, even under
``TYPE_CHECKING``; inside ``backends/mindspore/`` each wing imports only the wings below it, and a family's own
modules are reached only through the registry."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.support.paths import REPO


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports (``from x import y`` gives ``x`` and ``x.y``; a relative import as the
    absolute name it stands for)."""
    names: set[str] = set()
    package = module_name(path).split(".")[:None if path.name == "__init__.py" else -1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = [*package[:len(package) - node.level + 1], *(node.module or "").split(".")] if node.level \
                else node.module.split(".")
            module = ".".join(p for p in base if p)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # each package read once per run (several rules ask; none changes what it gets)
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


# backends/mindspore/'s wings from the top down (docs/architecture.md, "The backend's wings"): the engine builds and
# checks everything; the model sources make model directories with the registry's help; the runners build the
# networks the families name; families read a model directory with the shared readers and build on the shared
# layers; planning sizes what the layers hold; the kernels run them; modeldir is the model directory's vocabulary.
WINGS = ("engine", "sources", "runners", "families", "network", "planning", "kernels", "modeldir")
MINDSPORE = "backends.mindspore"


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == MINDSPORE.split(".") and len(parts) > 2 and parts[2] in WINGS else None


def test_the_backend_wings_are_the_folders() -> None:
    folders = {p.name for p in (REPO / "backends" / "mindspore").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(WINGS)


def test_each_backend_wing_imports_only_the_wings_below_it() -> None:
    """TYPE_CHECKING and function-local imports included."""
    up = {module: sorted(n for n in names if wing_of(n) and WINGS.index(wing_of(n)) < WINGS.index(wing_of(module)))
          for module, names in package_modules("backends").items() if wing_of(module)}
    assert not {m: n for m, n in up.items() if n}


def test_a_family_is_reached_only_through_the_registry() -> None:
    """Outside ``families/``, the backend names a family's modules nowhere: it asks ``families`` (the registry and
    its lookups) for the record, and the record names its networks and its vision part."""
    families = REPO / "backends" / "mindspore" / "families"
    own = {p.stem for p in families.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    own -= {"__init__", "family"}  # the registry: its lookups and what an entry declares
    reach = {module: sorted(n for n in names if n.startswith(f"{MINDSPORE}.families.") and n.split(".")[3] in own)
             for module, names in {**package_modules("backends"), **package_modules("bench")}.items()
             if not module.startswith(f"{MINDSPORE}.families")}
    assert not {m: n for m, n in reach.items() if n}
