"""The one ``lib`` fixture of the reference-bits tests: the kernel library built into a fresh cache directory
once per module (the build itself is under test). It lives here alone so it can later be parametrized by ISA
variant, every test below then running against each."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The kernel library (ctypes) built into a fresh cache directory."""
    from backends.mindspore.kernels import kernel_library
    return kernel_library(tmp_path_factory.mktemp("kernel_cache"))
