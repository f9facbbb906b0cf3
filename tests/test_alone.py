"""tests/support/alone.py, the ``alone`` mark's locks: an ``alone`` test waits for the shared holders running now,
and while it waits or runs, no new shared holder gets in (the turnstile). Threads stand in for the workers."""
from __future__ import annotations

import fcntl
import os
import threading
import time

from tests.support.alone import turn

WAIT = 60  # seconds; only a hang gets near it


def gate_shut(run_dir) -> bool:
    fd = os.open(run_dir / "alone-gate.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def until(predicate) -> bool:
    deadline = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_alone_test_waits_for_the_running_ones_and_shuts_the_gate(tmp_path):
    inside, release = threading.Event(), threading.Event()

    def alone():
        with turn(tmp_path, alone=True):
            inside.set()
            release.wait(WAIT)

    with turn(tmp_path, alone=False):  # a test running on the other worker
        waiter = threading.Thread(target=alone)
        waiter.start()
        assert until(lambda: gate_shut(tmp_path)), "the alone test never reached the gate"
        assert not inside.is_set()  # it waits for the running test
    assert inside.wait(WAIT)
    assert gate_shut(tmp_path)  # no other test starts while it runs
    release.set()
    waiter.join(WAIT)
    assert not gate_shut(tmp_path)
    with turn(tmp_path, alone=False), turn(tmp_path, alone=False):  # shared holders do not wait for each other
        pass
