"""The ``alone`` mark under pytest-xdist: the workers run tests at the same time, and a test marked ``alone`` (one
whose checks read the whole machine, e.g. the memory free now) runs while the other workers wait. Every test holds
a shared lock from its setup to its teardown, an ``alone`` test the exclusive one; a turnstile in front lets a
waiting ``alone`` test in before any further shared holder. Both lock files sit in the run's own temp directory
(the workers' common parent), so two runs never wait for each other."""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def turn(run_dir: Path, alone: bool) -> Iterator[None]:
    gate = os.open(run_dir / "alone-gate.lock", os.O_CREAT | os.O_RDWR, 0o644)
    run = os.open(run_dir / "alone-run.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(run, fcntl.LOCK_EX)  # the gate stays shut until this test is done
        else:
            fcntl.flock(run, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        os.close(run)
        os.close(gate)
