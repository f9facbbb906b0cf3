"""Where the benchmarks find the repository, its default model, the golden answer and llama.cpp's builds."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / ".cache" / "models"
MODEL_DIR = CACHE_DIR / "SmolLM2-135M-Instruct"
LLAMA_ANCHORS = Path.home() / ".cache" / "llama-anchors"  # llama-server + its .so files (bench/README.md)
BENCH_VENV_PY = LLAMA_ANCHORS / "venv" / "bin" / "python"  # llama-cpp-python[server], same build script
SERVER_YAML = REPO / "configs" / "server.yaml"
GOLDEN = REPO / "tests" / "golden" / "smollm2_greedy.json"
