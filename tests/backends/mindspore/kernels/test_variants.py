"""The build variants of the kernels (build.py): which one a CPU gets, and that every variant this machine can run
gives the very bits of the native one on every entry (tests/support/kernel_entries.py), scalar included; each
variant's machine code holds no instruction above its level (objdump), the AArch64 ones cross-compiled."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from backends.mindspore.kernels import build as kbuild
from tests.support.kernel_variants import HOST_VARIANTS, MACHINE, NATIVE, variant_lib
from tests.support.kernel_entries import cases

ZEN3 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 abm movbe aes sha_ni".split())
SAPPHIRE = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "amx_int8"}
KUNPENG = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma "
                    "dcpop asimddp asimdfhm".split())
CORTEX_A57 = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid".split())


@pytest.mark.parametrize("machine,features,want", [
    ("x86_64", SAPPHIRE, "x86-64-v4-vnni"),
    ("x86_64", SAPPHIRE - {"avx512_vnni"}, "x86-64-v4"),
    ("x86_64", ZEN3, "x86-64-v3"),
    ("x86_64", ZEN3 - {"avx2"}, "scalar"),
    ("aarch64", KUNPENG, "armv8.2-dotprod"),
    ("aarch64", CORTEX_A57, "armv8"),
    ("ppc64le", frozenset({"altivec"}), "scalar"),
])
def test_the_best_variant_the_cpu_runs_is_chosen(machine, features, want, monkeypatch):
    monkeypatch.delenv(kbuild.ISA_ENV, raising=False)
    assert kbuild.choose_variant(None, machine, features).name == want


def test_a_lower_variant_can_be_forced_and_a_higher_one_is_refused_naming_what_is_missing(monkeypatch):
    monkeypatch.setenv(kbuild.ISA_ENV, "x86-64-v3")
    assert kbuild.choose_variant(None, "x86_64", SAPPHIRE).name == "x86-64-v3"
    assert kbuild.choose_variant("scalar", "x86_64", SAPPHIRE).name == "scalar"  # the argument wins
    with pytest.raises(kbuild.KernelBuildError, match="x86-64-v4-vnni.*lacks: avx512_vnni, avx512bw, avx512cd"):
        kbuild.choose_variant("x86-64-v4-vnni", "x86_64", ZEN3)
    with pytest.raises(kbuild.KernelBuildError, match="'armv8' is for aarch64 CPUs; this machine is x86_64"):
        kbuild.choose_variant("armv8", "x86_64", SAPPHIRE)
    with pytest.raises(kbuild.KernelBuildError, match=r"unknown kernel variant 'avx9' \(variants: x86-64-v4-vnni, "):
        kbuild.choose_variant("avx9", "x86_64", SAPPHIRE)


def test_cpu_features_read_x86_flags_and_arm_features():
    assert kbuild.cpu_features("processor\t: 0\nflags\t\t: fpu avx2 fma\n\nflags : other\n") == {"fpu", "avx2", "fma"}
    assert kbuild.cpu_features("processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU part\t: 0xd01\n") == {
        "fp", "asimd", "asimddp"}
    assert kbuild.cpu_features("") == frozenset()


def test_each_variant_has_its_own_flags_and_cache_key():
    flags = {v.name: kbuild.compile_flags(v, "x86_64") for v in kbuild.VARIANTS}
    assert len(set(flags.values())) == len(flags)
    assert all("-ffp-contract=off" in f and not any("native" in x for x in f) for f in flags.values())
    assert "-march=x86-64" in flags["scalar"] and "-DMINDSERVE_VEC_SCALAR" in flags["scalar"]
    assert "-march=armv8-a" in kbuild.compile_flags(kbuild.variant_named("scalar"), "aarch64")


CASES = cases()


@pytest.fixture(scope="module")
def native_results(kernel_cache):
    lib = variant_lib(kernel_cache, NATIVE)
    return {c.name: c.run(lib) for c in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("name", HOST_VARIANTS)
def test_every_variant_gives_the_native_bits_on_every_entry(kernel_cache, native_results, name):
    lib = variant_lib(kernel_cache, name)
    assert lib.mindserve_kernel_variant().decode() == name
    for case in CASES:
        rc, arrays = case.run(lib)
        want_rc, want = native_results[case.name]
        assert rc == want_rc == 0, (case.name, rc)
        for i, (got, ref) in enumerate(zip(arrays, want)):
            same = got.view(np.uint8) == ref.view(np.uint8)
            assert same.all(), f"{case.name}: argument {i} differs from {NATIVE} at byte {np.argmin(same.ravel())}"
        assert not any(np.isnan(a).any() for a in arrays if a.dtype == np.float32), case.name  # all written


def _disassembly(path, objdump: str = "objdump") -> str:
    return subprocess.run([objdump, "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                          check=True).stdout


# Instructions a variant must not contain (checked on the whole library: the C++ runtime inlined into it too).
FORBIDDEN = {
    "x86-64-v4": re.compile(r"\bvpdpbusds?\b"),
    "x86-64-v3": re.compile(r"%zmm|\{evex\}|\bvpdpbusds?\b|%k[0-7]"),
    "scalar": re.compile(r"%ymm|%zmm|\bvfmadd|\bvpdpbusd"),
}
REQUIRED = {"x86-64-v4-vnni": re.compile(r"\bvpdpbusd\b"), "x86-64-v4": re.compile(r"%zmm"),
            "x86-64-v3": re.compile(r"\bvfmadd\d+ps\s.*%ymm")}


@pytest.mark.slow
@pytest.mark.skipif(MACHINE != "x86_64" or shutil.which("g++") is None, reason="the x86 variants, on an x86 box")
@pytest.mark.parametrize("name", ["x86-64-v4-vnni", "x86-64-v4", "x86-64-v3", "scalar"])
def test_no_x86_variant_holds_an_instruction_above_its_level(kernel_cache, name):
    text = _disassembly(kbuild.build_kernel(kernel_cache, variant=name, check_cpu=False))
    if name in FORBIDDEN:
        hit = FORBIDDEN[name].search(text)
        assert hit is None, f"{name} holds {hit.group(0)!r}"
    if name in REQUIRED:
        assert REQUIRED[name].search(text), f"{name} does not use its own instructions"


ARM_CXX, ARM_OBJDUMP = "aarch64-linux-gnu-g++", "aarch64-linux-gnu-objdump"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(ARM_CXX) is None or shutil.which(ARM_OBJDUMP) is None,
                    reason=f"needs {ARM_CXX} and {ARM_OBJDUMP} (Debian g++-aarch64-linux-gnu)")
def test_the_armv8_variant_has_no_dot_product_and_the_dotprod_one_uses_it(kernel_cache):
    plain = _disassembly(kbuild.build_kernel(kernel_cache, ARM_CXX, "armv8", check_cpu=False), ARM_OBJDUMP)
    dot = _disassembly(kbuild.build_kernel(kernel_cache, ARM_CXX, "armv8.2-dotprod", check_cpu=False), ARM_OBJDUMP)
    assert not re.search(r"\b[su]dot\b", plain)
    assert re.search(r"\bsdot\b", dot)
