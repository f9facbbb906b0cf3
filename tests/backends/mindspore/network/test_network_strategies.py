"""The network is a strategy (STYLE 17): the AOT and stock-op layer classes are chosen with the runner, so no
network class stores a flag its methods would ask again."""
from __future__ import annotations

import ast

import pytest

from tests.support.paths import REPO

NETWORK_FILES = sorted((REPO / "backends" / "mindspore" / "network").glob("*.py")) + [
    REPO / "backends" / "mindspore" / "families" / "qwen2_vl" / "text.py",
    REPO / "backends" / "mindspore" / "families" / "gemma3" / "network.py",
    REPO / "backends" / "mindspore" / "families" / "qwen3_moe" / "network.py"]
FLAGS = {"lora", "vl", "fused", "fast"}


def _flag_attributes(path) -> list[str]:
    found = []
    for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and node.attr in FLAGS):
                found.append(f"{cls.name}.{node.attr}")
    return found


@pytest.mark.parametrize("path", NETWORK_FILES, ids=lambda p: p.name)
def test_no_network_class_stores_a_strategy_flag(path):
    assert not _flag_attributes(path)


def test_one_vocabulary_for_the_kernel_path():
    """ "aot" | "stock" everywhere (no other name)."""
    from backends.mindspore.runners import KERNELS, PackedRunner, SplitRunner

    assert KERNELS == ("auto", "aot", "stock")
    assert (PackedRunner.kernels, SplitRunner.kernels) == ("aot", "stock")
