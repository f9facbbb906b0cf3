"""``mindserve serve`` as a real subprocess, optionally with every decode step slowed (so that requests are
still running when a test signals the server): the real CLI, signal handlers, drain and exit code."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.paths import REPO

# Runs `python -m service serve ...` with every decode step slowed by argv[1] seconds.
BOOTSTRAP = """
import sys, time
from backends.mindspore.runners import ModelRunner
decode, delay = ModelRunner.decode, float(sys.argv[1])
def slow(self, *args, **kwargs):
    time.sleep(delay)
    return decode(self, *args, **kwargs)
ModelRunner.decode = slow
from service.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


class Served:
    """A ``mindserve serve`` subprocess; ``url`` once it listens, ``log`` its stderr lines."""

    def __init__(self, config_path: Path | None, slow_decode: float = 0.0, serve_args: tuple[str, ...] = ()) -> None:
        """``serve --config config_path`` (None: no --config), then ``serve_args`` (MODEL ..., flags)."""
        config = ["--config", str(config_path)] if config_path is not None else []
        cmd = [sys.executable, "-c", BOOTSTRAP, str(slow_decode), "serve", *config, *serve_args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()

    def wait_url(self, timeout: float = 240) -> str:
        """The business URL, once the model is warmed up (the "ready: ... listening on URL" line)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = [re.search(r"ready: .* listening on (https?://\S+)", line) for line in list(self.log)]
            url = next((m.group(1) for m in found if m), None)
            if url:
                return url
            time.sleep(0.2)
        raise AssertionError("server did not start:\n" + self.text()[-3000:])

    def text(self) -> str:
        return "".join(self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
