"""The kernels compute in one floating-point mode whatever the calling thread's (kernels/fpenv.h): MindSpore runs an
AOT entry on its own pool threads, which flush subnormals to zero (FTZ + DAZ on x86, FZ on ARM), while the NumPy
reference and our pool's workers keep them. Every entry (tests/support/kernel_entries.py), on inputs whose first row
is subnormal, gives the same bits called from a flushing thread as from a default one, on every variant this machine
runs; the caller's mode is back afterwards. (The pool's workers set the mode when they start; no test here can make
one of them take a chunk on demand, so that half is by construction, pool.h.)"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests.support.kernel_entries import Case, cases
from tests.support.kernel_variants import HOST_VARIANTS, variant_lib

pytestmark = pytest.mark.slow  # every test builds the kernel library (kernel_cache); CASES imports MindSpore


def _mode_calls(lib):
    lib.mindserve_swap_fp_mode.argtypes = [ctypes.c_uint64]
    lib.mindserve_swap_fp_mode.restype = ctypes.c_uint64
    lib.mindserve_flush_fp_mode.restype = ctypes.c_uint64
    flush = lib.mindserve_flush_fp_mode()
    if flush == 0:
        pytest.skip("no floating-point mode register on this architecture")
    return lib.mindserve_swap_fp_mode, flush


def _with_subnormal_rows(case: Case, rng: np.random.Generator) -> Case:
    """The case with the first row of every float32 input matrix (not the NaN-filled outputs) made subnormal."""
    arrays = []
    for a in case.arrays:
        if a.dtype == np.float32 and a.ndim >= 2 and a.shape[0] > 1 and not np.isnan(a).all():
            a = a.copy()
            a[0] = (rng.standard_normal(a.shape[1:]) * 1e-40).astype(np.float32)
        arrays.append(a)
    return Case(case.name, case.entry, tuple(arrays))


CASES = cases()


@pytest.fixture(scope="module", params=HOST_VARIANTS)
def lib(kernel_cache, request):
    return variant_lib(kernel_cache, request.param)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_flushing_caller_gets_the_default_modes_bits(lib, case):
    swap, flush = _mode_calls(lib)
    case = _with_subnormal_rows(case, np.random.default_rng(3))
    want_rc, want = case.run(lib)
    old = swap(flush)
    try:
        got_rc, got = case.run(lib)
        inside = swap(flush)  # the entry gave the caller its mode back
    finally:
        swap(old)
    assert inside & ~0x3F == flush & ~0x3F, f"the caller's mode after the call is {inside:#x}, not {flush:#x}"
    assert got_rc == want_rc == 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), f"{case.name}: array {i} differs"
