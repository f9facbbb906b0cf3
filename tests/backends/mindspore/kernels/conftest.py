"""Fixtures of the kernel tests. The library is built once per test run and variant into one cache
(``test_build_is_cached_and_keyed`` checks a fresh build on its own); ``lib`` runs each test once per SIMD variant
of this machine's architecture, and a variant this CPU cannot run is reported as skipped by name, never passed."""
from __future__ import annotations

import os
import shutil

import pytest

from tests.support.kernel_variants import SIMD_VARIANTS, skip_unless_runs


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
    """One cache for the whole run: under pytest-xdist, beside the workers' own temp directories (their common
    parent), so no variant is compiled twice (a second builder waits for the first: build.py's lock)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.mktemp("kernel_cache")
    shared = tmp_path_factory.getbasetemp().parent / "kernel_cache"
    shared.mkdir(exist_ok=True)
    return shared


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
