"""Media files under the media root: the resolved path inside the root (no ``..``, which ``parts.py``
refuses already; no symlink leading out), regular files only, read up to a byte limit. Blocking: the
loader runs it on its executor."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from service.media.errors import OverLimit
from service.media.parts import MediaRef

READ_CHUNK = 1 << 20
_PROC_FD = Path("/proc/self/fd")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve(ref: MediaRef, root: Path) -> str:
    """The real path ``ref`` names (a relative path is relative to ``root``), refused unless it is inside
    the real root."""
    real_root = os.path.realpath(root)
    if not os.path.isdir(real_root):
        raise ref.refused(f"local media are not available: the media root {root} is not a directory on this server")
    given = ref.location if os.path.isabs(ref.location) else os.path.join(real_root, ref.location)
    if not _inside(os.path.abspath(given), real_root) and not _inside(os.path.abspath(given), str(root)):
        raise ref.refused(f"a local media file must be under the media root {root}")
    real = os.path.realpath(given)
    if not _inside(real, real_root):
        raise ref.refused(f"the path leads out of the media root {root} (through a symbolic link)")
    return real


def read_local(ref: MediaRef, root: Path, limit: int) -> bytes:
    """The bytes of the regular file ``ref`` names under ``root``; ``OverLimit`` past ``limit`` bytes."""
    real = resolve(ref, root)
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise ref.refused("no such file under the media root") from None
    except OSError as exc:
        raise ref.refused(f"cannot be read: {exc.strerror}") from None
    _check_regular(ref, info)
    if info.st_size > limit:
        raise OverLimit(info.st_size, declared=True)
    try:  # O_NONBLOCK: a FIFO swapped in since the stat must not block the open
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ref.refused(f"cannot be opened: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        _check_regular(ref, os.fstat(fd))
        _check_opened(ref, fd, root)
        return _read(file, limit)


def _check_regular(ref: MediaRef, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise ref.refused("is a directory, not a regular file")
    if not stat.S_ISREG(info.st_mode):
        raise ref.refused("is not a regular file (a device, FIFO or socket)")


def _check_opened(ref: MediaRef, fd: int, root: Path) -> None:
    """The file actually opened is inside the root (a path component swapped for a link after the check
    would show here); Linux's /proc tells, elsewhere the check before the open stands alone."""
    try:
        opened = os.readlink(_PROC_FD / str(fd))
    except OSError:
        return
    if not _inside(opened, os.path.realpath(root)):
        raise ref.refused(f"the path leads out of the media root {root} (it changed while being opened)")


def _read(file, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := file.read(min(READ_CHUNK, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise OverLimit(size)
    return b"".join(chunks)
