"""A first start a user can read: ``mindserve serve`` (the real CLI process, graph cache on) on a fresh graph cache
(a new HOME; the AOT kernel build shared, as on any start after the first) logs no MindSpore ``[WARNING]`` /
``[ERROR]`` line and no Python warning, and says what it does, in order: loading, kernels, loaded, graph cache
(empty: compiling), warm-up done, ready."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from tests.support.cli import server_config
from tests.support.paths import REPO

pytestmark = pytest.mark.slow  # a server process, compiled graphs

PHASES = ("loading model", "kernels: AOT", "loaded model", "graph cache:", "warm-up done", "ready:")
# MindSpore's C++ and Python log lines ("[WARNING] PIPELINE(pid,...)", "[ERROR] ME(pid:...)"), anywhere in a line
# (a progress bar's \r-redrawn line carries them too), and Python's warnings ("DeprecationWarning: ...").
TROUBLE = re.compile(r"\[(WARNING|ERROR|CRITICAL)\] \w+\(|\b\w+Warning: ")
_MS_LOG_ENV = ("GLOG_v", "MS_SUBMODULE_LOG_v")  # the user's MindSpore log levels: left unset, as a user's are


def _first_start(tmp_path, model_dir) -> list[str]:
    """The whole stderr of a start on an empty graph cache, from launch to ``ready:``, then SIGTERM."""
    from backends.mindspore.kernels.build import default_cache_dir

    home = tmp_path / "home"
    (home / ".cache" / "mindserve").mkdir(parents=True)
    (home / ".cache" / "mindserve" / "kernels").symlink_to(default_cache_dir(), target_is_directory=True)
    config = server_config(model_dir)
    config["BackendConfig"]["ModelDeployConfig"]["graphCache"] = True
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in _MS_LOG_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--config", str(path)], cwd=REPO,
                            stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1", "HOME": str(home)})
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not any("ready:" in x for x in list(log)):
            time.sleep(0.2)
        assert any("ready:" in x for x in log), "".join(log)[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(10)
        return log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_first_start_logs_no_mindspore_warning_and_our_phases_in_order(tmp_path, default_model_dir):
    log = _first_start(tmp_path, default_model_dir)
    trouble = [line for line in log if TROUBLE.search(line)]
    assert not trouble, "".join(trouble)[-3000:]
    at = [next((i for i, line in enumerate(log) if phase in line), -1) for phase in PHASES]
    assert -1 not in at and at == sorted(at), (dict(zip(PHASES, at)), "".join(log)[-3000:])
    assert "empty: compiling" in log[at[PHASES.index("graph cache:")]]
