"""Running the ``mindserve`` command line as a real subprocess, and a small server config for it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

CLI = [sys.executable, "-m", "service"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def server_config(model_dir: Path, **server) -> dict:
    return {
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 0, "httpsEnabled": False, **server},
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 64, "maxInputTokenLen": 48,
                                  "ModelConfig": [{"modelName": "tiny", "modelWeightPath": str(model_dir),
                                                   "backendType": "ms"}]},
            "ScheduleConfig": {"maxBatchSize": 2, "maxPrefillBatchSize": 1, "maxIterTimes": 32,
                               "cacheBlockSize": 16, "batchBuckets": [1, 2], "windowBuckets": [64]},
        },
    }
