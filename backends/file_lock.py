"""One writer at a time in a cache directory shared by processes (two servers of a fleet starting at once, two test
workers): an exclusive ``flock`` on the directory itself, so no lock file is left behind, and the kernel lets go
when the holder exits or dies, so a crash never leaves a stale lock. Whoever waits re-checks the cache afterwards:
the first holder has usually made what it wanted."""
from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("mindserve.cache")


@contextmanager
def directory_lock(directory: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Hold ``directory``'s lock (waiting for another holder, logged once with ``what`` it is waiting to do). Not
    re-entrant: a second ``directory_lock`` of the same directory inside the first waits forever."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish in %s before %s", Path(directory), what)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor of the open file lets go of the lock
