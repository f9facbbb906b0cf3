"""Fixtures of the kernel tests: each module builds the AOT kernel library into its own fresh cache directory
(the build itself is under test), once per module."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel_cache")


@pytest.fixture(scope="module")
def lib(cache_dir):
    """The kernel library (ctypes) built into ``cache_dir``."""
    from backends.mindspore.kernels import kernel_library
    return kernel_library(cache_dir)
