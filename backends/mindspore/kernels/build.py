"""Compile the kernels (``SOURCES`` and their ``HEADERS``) into one shared library per named variant on first use,
cached by content (one library, so every kernel shares the one thread pool).

A variant is one instruction-set level with fixed compiler flags (``VARIANTS``): the same sources compile to
the AVX-512, AVX2, NEON or scalar backend of ``vec.h``, and every variant gives the same output bits. The
variant is picked from this CPU's features (``/proc/cpuinfo`` ``flags`` on x86, ``Features`` on ARM) before
anything is loaded -- never by trying to load a library, which could die of an illegal instruction -- and a
lower one can be forced (``MINDSERVE_KERNEL_ISA`` or the server config's ``kernelIsa``).

The sources are package data, read through ``importlib.resources`` (a wheel ships them like the source tree
does). The cache key hashes them, the compiler command and version and the variant's flags; it needs no CPU
model, since no variant uses ``-march=native``. The compiler reads a copy of the very bytes that were hashed,
written to a temporary directory, and the library is written to a temporary file in the cache directory and
renamed into place, so readers never see a half-written file; builders take turns (``file_lock.py``), so the
second finds the first one's library instead of compiling it again.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from backends.file_lock import directory_lock

log = logging.getLogger("mindserve.engine")

# The slowest to compile first (the build runs them over the CPUs in this order): the quantized tiles, by format.
SOURCES = ("qtiles_q8_q4.cc", "qtiles_q6k.cc", "qtiles_q5.cc", "attention.cc", "qtiles_q4k.cc", "qtiles_q5k.cc",
           "matmul.cc", "fused.cc", "qmatmul.cc", "fused_entries.cc", "lora.cc", "quantize.cc", "moe.cc", "pack.cc",
           "vocab.cc", "stack.cc")
HEADERS = ("entry.h", "fused.h", "pool.h", "lora.h", "qmatmul.h", "qformat.h", "qtable.h", "qtile.h", "quantize.h",
           "vec.h", "vec_avx512.h", "vec_avx2.h", "vec_neon.h", "vec_scalar.h", "kv_format.h", "fpenv.h")
# Every variant: no contraction of a * b + c into an fma (vec.h's contract), no fast-math.
CXXFLAGS = ("-O3", "-std=c++20", "-fPIC", "-shared", "-pthread", "-Wall", "-Wno-maybe-uninitialized",
            "-ffp-contract=off", "-fno-fast-math")
ISA_ENV = "MINDSERVE_KERNEL_ISA"

_X86_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "popcnt", "sse4_1", "sse4_2",
                     "ssse3"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its name, the machine it is for, its compiler flags and the CPU features
    (as ``/proc/cpuinfo`` names them) it needs."""

    name: str
    machine: str  # platform.machine() of the hosts it runs on; "" = any
    flags: tuple[str, ...]
    needs: frozenset[str]


# Best first: the probe takes the first one this CPU can run.
VARIANTS = (
    Variant("x86-64-v4-vnni", "x86_64", ("-march=x86-64-v4", "-mavx512vnni"), _X86_V4 | {"avx512_vnni"}),
    Variant("x86-64-v4", "x86_64", ("-march=x86-64-v4",), _X86_V4),
    Variant("x86-64-v3", "x86_64", ("-march=x86-64-v3",), _X86_V3),
    Variant("armv8.2-dotprod", "aarch64", ("-march=armv8.2-a+dotprod",), frozenset({"asimd", "asimddp"})),
    Variant("armv8", "aarch64", ("-march=armv8-a",), frozenset({"asimd"})),
    Variant("scalar", "", ("-DMINDSERVE_VEC_SCALAR",), frozenset()),
)
_BY_NAME = {v.name: v for v in VARIANTS}
_SCALAR_MARCH = {"x86_64": ("-march=x86-64",), "aarch64": ("-march=armv8-a",)}


class KernelBuildError(RuntimeError):
    """The fast kernel could not be compiled (no compiler, no variant for this CPU, compile error)."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "mindserve" / "kernels"


def _compiler(cxx: str | None) -> str:
    found = shutil.which(cxx) if cxx else (shutil.which("g++") or shutil.which("c++"))
    if not found:
        raise KernelBuildError(
            f"cannot build the mindserve fast kernels: no C++ compiler found ({cxx or 'g++/c++'}; "
            "install g++, e.g. `apt-get install g++`)")
    return found


def compiler_found(cxx: str | None = None) -> bool:
    """Whether ``cxx`` (default g++, else c++) is on PATH."""
    try:
        _compiler(cxx)
    except KernelBuildError:
        return False
    return True


def header_constant(header: str, name: str) -> int:
    """An integer ``constexpr`` of a kernel header, read from the header's text without building anything (for
    the rules judged before the library exists; the built library exports the same value: ``kernel_constants``)."""
    text = (resources.files(__package__) / header).read_text(encoding="utf-8")
    found = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*(\d+)\s*;", text)
    if found is None:
        raise KernelBuildError(f"{header} defines no integer constexpr {name}")
    return int(found.group(1))


def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The ISA features of this CPU: the first ``flags`` (x86) or ``Features`` (ARM) line of /proc/cpuinfo
    (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def variant_named(name: str) -> Variant:
    """The variant called ``name``; KernelBuildError listing the names if there is none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KernelBuildError(f"unknown kernel variant {name!r} (variants: {', '.join(_BY_NAME)})") from None


def runs_here(v: Variant, machine: str | None = None, features: frozenset[str] | None = None) -> bool:
    """Whether this machine (``platform.machine()``, ``cpu_features()`` unless given) can run ``v``."""
    machine = platform.machine() if machine is None else machine
    features = cpu_features() if features is None else features
    return (not v.machine or v.machine == machine) and v.needs <= features


def choose_variant(requested: str | None = None, machine: str | None = None,
                   features: frozenset[str] | None = None) -> Variant:
    """The variant to build: ``requested`` (else ``$MINDSERVE_KERNEL_ISA``; ``auto`` or unset = the best this CPU
    runs). A requested variant the CPU cannot run is a KernelBuildError naming the missing features."""
    requested = requested or os.environ.get(ISA_ENV) or "auto"
    machine = platform.machine() if machine is None else machine
    features = cpu_features() if features is None else features
    if requested == "auto":
        return next(v for v in VARIANTS if runs_here(v, machine, features))
    v = variant_named(requested)
    if v.machine and v.machine != machine:
        raise KernelBuildError(f"kernel variant {v.name!r} is for {v.machine} CPUs; this machine is {machine}")
    missing = v.needs - features
    if missing:
        raise KernelBuildError(f"kernel variant {v.name!r} needs CPU features this CPU lacks: "
                               f"{', '.join(sorted(missing))}")
    return v


def compile_flags(v: Variant, machine: str | None = None) -> tuple[str, ...]:
    """The whole compiler command line of ``v`` but the sources and -o (for ``machine``, default this one)."""
    machine = platform.machine() if machine is None else machine
    arch = _SCALAR_MARCH.get(machine, ()) if v.name == "scalar" else ()
    return (*CXXFLAGS, *arch, *v.flags, f'-DMINDSERVE_VARIANT="{v.name}"')


def build_kernel(cache_dir: str | os.PathLike | None = None, cxx: str | None = None, variant: str | None = None,
                 check_cpu: bool = True) -> Path:
    """Return the path of the compiled kernel library, building it first if needed.

    ``cache_dir`` defaults to ``~/.cache/mindserve/kernels``; ``cxx`` is the compiler to use (default: ``g++``,
    else ``c++``, from PATH); ``variant`` a name of ``VARIANTS`` or ``auto`` (default: ``choose_variant()``).
    ``check_cpu=False`` builds a named variant this CPU cannot run (to inspect it, never to load it).
    """
    chosen = choose_variant(variant) if check_cpu or variant in (None, "auto") else variant_named(variant)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    files = read_sources()
    source = b"\0".join(files.values())
    cxx = _compiler(cxx)
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx!r}: {exc}") from exc
    flags = compile_flags(chosen)
    digest = hashlib.sha256()
    for part in (source, cxx.encode(), version.encode(), " ".join(flags).encode()):
        digest.update(part)
        digest.update(b"\0")
    target = cache / f"mindserve_kernels_{chosen.name}_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with directory_lock(cache, f"compiling {target.name}"):  # one build at a time: the others find it made
        if not target.exists():
            _build(files, cxx, flags, chosen.name, cache, target)
    return target


def _build(files: dict[str, bytes], cxx: str, flags: Sequence[str], variant: str, cache: Path, target: Path) -> None:
    log.info("compiling the AOT kernels (%s, %s) into %s: once per kernel source and compiler, a minute or two",
             variant, cxx, cache)
    started = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix=".src-", dir=cache) as src:
            for name, data in files.items():
                Path(src, name).write_bytes(data)
            compile_units(cxx, flags, src, os.path.abspath(tmp), variant)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: readers see either no file or the complete library
        log.info("compiled the AOT kernels in %.0fs: %s", time.perf_counter() - started, target.name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compile_units(cxx: str, flags: Sequence[str], src: str, out: str, name: str,
                  units: Sequence[str] | None = None) -> None:
    """Each of ``units`` (in ``src``) to an object file, as many at once as there are CPUs (the 2-core build takes
    about half the time of one compiler run over all of them), then the link into ``out`` with the same flags.
    ``units`` defaults to SOURCES. Raises KernelBuildError with the compiler's messages, naming ``name``, on any
    failure."""
    units = SOURCES if units is None else units

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=src)

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        procs = list(pool.map(run, ([cxx, *flags, "-c", f, "-o", f"{f}.o"] for f in units)))
    failed = [p for p in procs if p.returncode != 0]
    if not failed:
        link = run([cxx, *flags, "-o", out, *(f"{f}.o" for f in units)])
        failed = [link] if link.returncode != 0 else []
    if failed:
        raise KernelBuildError(f"compiling {', '.join(units)} for {name} failed ({cxx}):\n"
                               + "\n".join(p.stderr.strip() for p in failed))


def read_sources() -> dict[str, bytes]:
    """``{file name: bytes}`` of every kernel source and header, from the installed package."""
    package = resources.files(__package__)
    missing = [name for name in (*SOURCES, *HEADERS) if not (package / name).is_file()]
    if missing:
        raise KernelBuildError(f"the kernel sources {', '.join(missing)} are missing from {package} "
                               "(an install without the package data?)")
    return {name: (package / name).read_bytes() for name in (*SOURCES, *HEADERS)}
