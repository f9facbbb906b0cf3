"""Fixtures of the kernel tests. The library is built once per test run and variant into one session cache
(``test_build_is_cached_and_keyed`` checks a fresh build on its own); ``lib`` runs each test once per SIMD variant
of this machine's architecture, and a variant this CPU cannot run is reported as skipped by name, never passed."""
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


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel_cache")


@pytest.fixture(scope="session")
def cache_dir(kernel_cache):
    """The session cache, for tests that build the default variant (the GRAPH-mode tests)."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    return kernel_cache


@pytest.fixture(scope="session", params=SIMD_VARIANTS or ("scalar",))
def variant(request) -> str:
    skip_unless_runs(request.param)
    return request.param


@pytest.fixture(scope="session")
def lib(kernel_cache, variant):
    """The kernel library (ctypes) of ``variant``, built into the session cache."""
    from backends.mindspore.kernels import kernel_library
    return kernel_library(kernel_cache, variant)


def variant_lib(kernel_cache, name: str):
    """The library of variant ``name`` (skipped by name where this CPU cannot run it)."""
    from backends.mindspore.kernels import kernel_library
    skip_unless_runs(name)
    return kernel_library(kernel_cache, name)
