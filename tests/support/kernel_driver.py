"""The kernel driver (kernel_driver.cc): the kernels' AOT entries linked statically into a small program, built for
any compiler and flags (an aarch64 cross compiler included) and run natively or under ``qemu-aarch64 -cpu <model>``.

A run takes a list of requests (``Case`` of tests/support/kernel_entries.py: an entry and its arguments, inputs
then outputs, as MindSpore passes them; ``SetThreads``) and gives what ``Case.run`` gives on a loaded library, per
request: (return code, every argument after the call). ``run_library`` makes the same requests through ctypes, so
both sides compare as equals.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import signal
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.file_lock import directory_lock
from backends.mindspore.kernels.build import (SOURCES, KernelBuildError, compile_units, default_cache_dir,
                                              read_sources)
from tests.support.kernel_entries import Case, dtype_name

DRIVER_SOURCE = Path(__file__).with_name("kernel_driver.cc")
_REQ_MAGIC, _RES_MAGIC = b"MSKDREQ1", b"MSKDRES1"
_CALL, _THREADS = 1, 2


@dataclass(frozen=True)
class SetThreads:
    n: int  # kernel threads, the caller included (mindserve_matmul_set_threads)


Request = Case | SetThreads
Result = tuple[int, list[np.ndarray]]  # as Case.run: the return code (SetThreads: the thread count now), the arrays


class DriverError(RuntimeError):
    """The driver could not be built, or its run did not finish."""


def driver_cache_dir() -> Path:
    return default_cache_dir().parent / "drivers"


def build_driver(cxx: str, library_flags: Sequence[str], cache_dir: Path | None = None) -> Path:
    """The driver built by ``cxx`` with the kernel library's own flags (``-shared`` dropped, ``-static`` added),
    cached by content: the kernel sources, the driver source, the compiler and its version, the flags."""
    found = shutil.which(cxx)
    if not found:
        raise DriverError(f"no compiler {cxx!r} on PATH")
    flags = [f for f in library_flags if f != "-shared"] + ["-static"]
    files = {**read_sources(), DRIVER_SOURCE.name: DRIVER_SOURCE.read_bytes()}
    version = subprocess.run([found, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (*files.values(), found.encode(), version.encode(), "\0".join(flags).encode()):
        digest.update(hashlib.sha256(part).digest())
    cache = Path(cache_dir) if cache_dir is not None else driver_cache_dir()
    target = cache / f"kernel_driver_{digest.hexdigest()[:20]}"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with directory_lock(cache, f"building {target.name}"):  # as build.py: one build at a time
        if not target.exists():
            _build(found, flags, files, cache, target)
    return target


def _build(found: str, flags: Sequence[str], files: dict[str, bytes], cache: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".build-", dir=cache)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix=".src-", dir=cache) as src:
            for name, data in files.items():
                Path(src, name).write_bytes(data)
            try:  # the library's sources, the slowest first, then the driver: compiled side by side, linked
                compile_units(found, flags, src, os.path.abspath(tmp), "the kernel driver",
                              units=(*SOURCES, DRIVER_SOURCE.name))
            except KernelBuildError as exc:
                raise DriverError(f"building the kernel driver failed ({' '.join(flags)}): {exc}") from exc
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic, as build.py does
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def qemu(cpu: str) -> list[str]:
    """The emulator prefix for an aarch64 driver on this host (binfmt_misc is not relied on)."""
    return ["qemu-aarch64", "-cpu", cpu]


def run_driver(driver: Path, requests: Sequence[Request], emulator: Sequence[str] = (),
               timeout: float = 900) -> list[Result]:
    """All requests in one run of ``driver`` (under ``emulator`` if given), in order."""
    with tempfile.TemporaryDirectory(prefix="kdriver-") as tmp:
        req, res = Path(tmp, "requests.bin"), Path(tmp, "results.bin")
        req.write_bytes(_encode(requests))
        try:
            proc = subprocess.run([*emulator, str(driver), str(req), str(res)], capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise DriverError(f"{' '.join([*emulator, driver.name])} did not finish in {timeout:g} s") from exc
        results = _decode(res.read_bytes() if res.exists() else b"", requests)
    if proc.returncode != 0 or len(results) != len(requests):
        raise DriverError(f"{' '.join([*emulator, driver.name])} {_exit_status(proc.returncode)} at request "
                          f"{len(results)} of {len(requests)} ({_describe(requests, len(results))}):\n"
                          f"{proc.stderr.strip()}")
    return results


def run_library(lib: ctypes.CDLL, requests: Sequence[Request]) -> list[Result]:
    """The same requests through ctypes on a loaded kernel library (``Case.run``: on copies of the arrays)."""
    return [(lib.mindserve_matmul_set_threads(r.n), []) if isinstance(r, SetThreads) else r.run(lib)
            for r in requests]


def _encode(requests: Sequence[Request]) -> bytes:
    out = [_REQ_MAGIC, struct.pack("<I", len(requests))]
    for r in requests:
        if isinstance(r, SetThreads):
            out.append(struct.pack("<Ii", _THREADS, r.n))
            continue
        out += [struct.pack("<I", _CALL), _text(r.entry), struct.pack("<I", len(r.arrays))]
        for a in r.arrays:
            data = np.ascontiguousarray(a).tobytes()
            out += [_text(dtype_name(a).decode()), struct.pack(f"<I{a.ndim}q", a.ndim, *a.shape),
                    struct.pack("<Q", len(data)), data]
    return b"".join(out)


def _text(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def _decode(data: bytes, requests: Sequence[Request]) -> list[Result]:
    """The complete records of a result file (a crashed run leaves the ones before the crash)."""
    if data[:8] != _RES_MAGIC:
        return []
    results, at = [], 8
    for r in requests:
        if at + 8 > len(data):
            break
        rc, n = struct.unpack_from("<iI", data, at)
        at += 8
        args = []
        for a in (r.arrays if isinstance(r, Case) else ())[:n]:
            if at + 8 > len(data):
                return results
            (size,) = struct.unpack_from("<Q", data, at)
            at += 8
            if at + size > len(data):
                return results
            args.append(np.frombuffer(data, a.dtype, a.size, at).reshape(a.shape).copy())
            at += size
        results.append((rc, args))
    return results


def _exit_status(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}" if code else "stopped early"


def _describe(requests: Sequence[Request], i: int) -> str:
    if i >= len(requests):
        return "none left"
    r = requests[i]
    return f"set_threads({r.n})" if isinstance(r, SetThreads) else \
        f"{r.name}: {r.entry} {', '.join(str(a.shape) for a in r.arrays)}"
