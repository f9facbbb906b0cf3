"""Compile the kernels (``matmul.cc``, ``qmatmul.cc``, ``attention.cc``, ``fused.cc``, ``lora.cc`` and their headers) into one shared
library on first use, cached by content (one library, so every kernel shares the one thread pool).

The sources are package data, read through ``importlib.resources`` (a wheel ships them like the source
tree does). The cache key hashes them, the compiler command and version, and the CPU's model and flag
list (the build uses ``-march=native``, so a library built on one CPU must not be reused on a
different one). The compiler reads a copy of the very bytes that were hashed, written to a temporary
directory, and the library is written to a temporary file in the cache directory and renamed into
place, so concurrent builders never see a half-written file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

SOURCES = ("matmul.cc", "attention.cc", "fused.cc", "lora.cc", "qmatmul.cc")
HEADERS = ("entry.h", "pool.h", "simd.h", "lora.h", "qmatmul.h")
CXXFLAGS = ("-O3", "-march=native", "-std=c++20", "-fPIC", "-shared", "-pthread", "-Wall")


class KernelBuildError(RuntimeError):
    """The fast kernel could not be compiled (no compiler, unsupported CPU, compile error)."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "mindserve" / "kernels"


def _compiler(cxx: str | None) -> str:
    found = shutil.which(cxx) if cxx else (shutil.which("g++") or shutil.which("c++"))
    if not found:
        raise KernelBuildError(
            f"cannot build the mindserve fast kernels: no C++ compiler found ({cxx or 'g++/c++'}; "
            "install g++, e.g. `apt-get install g++`)")
    return found


def _cpu_signature() -> str:
    """Model name + ISA flags of this CPU (Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    model = flags = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = " ".join(sorted(value.split()))
        if model and flags:
            break
    return f"{model}|{flags}"


def _has_avx512() -> bool:
    sig = _cpu_signature()
    return not sig or "avx512f" in sig.split("|", 1)[-1].split()


def build_kernel(cache_dir: str | os.PathLike | None = None, cxx: str | None = None) -> Path:
    """Return the path of the compiled kernel library, building it first if needed.

    ``cache_dir`` defaults to ``~/.cache/mindserve/kernels``; ``cxx`` is the compiler to use
    (default: ``g++``, else ``c++``, from PATH).
    """
    if not _has_avx512():
        raise KernelBuildError("the mindserve fast kernels need an AVX-512 CPU (avx512f)")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    files = read_sources()
    source = b"\0".join(files.values())
    cxx = _compiler(cxx)
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx!r}: {exc}") from exc
    digest = hashlib.sha256()
    for part in (source, cxx.encode(), version.encode(), " ".join(CXXFLAGS).encode(), _cpu_signature().encode()):
        digest.update(part)
        digest.update(b"\0")
    target = cache / f"mindserve_matmul_{digest.hexdigest()[:20]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix=".src-", dir=cache) as src:
            for name, data in files.items():
                Path(src, name).write_bytes(data)
            proc = subprocess.run([cxx, *CXXFLAGS, "-o", os.path.abspath(tmp), *SOURCES], capture_output=True,
                                  text=True, cwd=src)
        if proc.returncode != 0:
            raise KernelBuildError(f"compiling {', '.join(SOURCES)} failed ({cxx}):\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: readers see either no file or the complete library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def read_sources() -> dict[str, bytes]:
    """``{file name: bytes}`` of every kernel source and header, from the installed package."""
    package = resources.files(__package__)
    missing = [name for name in (*SOURCES, *HEADERS) if not (package / name).is_file()]
    if missing:
        raise KernelBuildError(f"the kernel sources {', '.join(missing)} are missing from {package} "
                               "(an install without the package data?)")
    return {name: (package / name).read_bytes() for name in (*SOURCES, *HEADERS)}
