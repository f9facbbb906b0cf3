"""The kernel build variants of this machine, for the kernel tests: which exist for its architecture, which it
runs, and a library of one of them (a variant the CPU cannot run is skipped by name, never passed)."""
from __future__ import annotations

import platform
import shutil

import pytest

from backends.mindspore.kernels import build as kbuild

MACHINE = platform.machine()
# The variants built for this architecture, best first; SIMD ones are what `lib` runs, scalar is the slow
# reference the cross-variant tests add.
HOST_VARIANTS = tuple(v.name for v in kbuild.VARIANTS if v.machine in ("", MACHINE))
SIMD_VARIANTS = tuple(name for name in HOST_VARIANTS if name != "scalar")
NATIVE = kbuild.choose_variant("auto").name


def skip_unless_runs(name: str) -> None:
    """Skip, naming the variant and what the CPU lacks, unless this machine runs variant ``name``."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    v = kbuild.variant_named(name)
    if not kbuild.runs_here(v):
        missing = ", ".join(sorted(v.needs - kbuild.cpu_features()))
        pytest.skip(f"kernel variant {name} not run: this CPU lacks {missing}")


def variant_lib(kernel_cache, name: str):
    """The library of variant ``name`` (skipped by name where this CPU cannot run it)."""
    from backends.mindspore.kernels import kernel_library
    skip_unless_runs(name)
    return kernel_library(kernel_cache, name)
