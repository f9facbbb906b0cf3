"""What the model cache holds (``mindserve models``) and removing from it (``mindserve rm``): the store's entries
and the default model's directories (``default_model.DEFAULT_DIRS``), each with its architecture, weight format,
size on disk and origin."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from backends.mindspore.sources.default_model import DEFAULT_DIRS, WHEEL_PROJECT
from backends.mindspore.sources.model_store import HF_FORMAT, ModelStore


@dataclass(frozen=True, slots=True)
class CachedModel:
    name: str
    arch: str
    format: str  # the conversion's --dtype and the weight formats it holds ("as-shipped q4_k+q6_k"), or "hf ..."
    size: int  # bytes on disk in the entry (an HF entry's weights stay in the user's directory)
    origin: str
    path: Path
    package: str | None = None


def cached_models(store: ModelStore) -> list[CachedModel]:
    """Every entry of the store and every default model directory in its root, by name."""
    models = [_of_record(entry, record) for entry, record in store.records()]
    for name in DEFAULT_DIRS:
        entry = store.root / name
        if (entry / "conversion.json").is_file():
            conversion = json.loads((entry / "conversion.json").read_text())
            models.append(CachedModel(name, _arch(entry), _format(entry, conversion.get("dtype", "fp32")),
                                      _size(entry), f"default model (pip {WHEEL_PROJECT})", entry))
    return sorted(models, key=lambda m: (m.name, m.format))


def downloads_size(store: ModelStore) -> int:
    """Bytes of the GGUFs packages carried, kept to convert again with another --dtype."""
    return _size(store.root / ".downloads")


def remove_models(store: ModelStore, name: str) -> list[CachedModel]:
    """Remove the entries called ``name`` (or whose directory is ``name``), and a package's download once no
    entry of it is left; the removed entries. Each entry is renamed away first, so no reader sees half of it."""
    gone = [m for m in cached_models(store) if name in (m.name, m.path.name)]
    for model in gone:
        trash = model.path.with_name(f".removing-{os.getpid()}-{model.path.name}")
        os.rename(model.path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    for package in {m.package for m in gone if m.package}:
        if not any(m.package == package for m in cached_models(store)):
            shutil.rmtree(store.root / ".downloads" / package, ignore_errors=True)
    return gone


def _of_record(entry: Path, record: dict) -> CachedModel:
    origin = record.get("origin", {})
    if origin.get("package"):
        where = f"pypi:{origin['package']} {origin.get('version', '')}".strip()
    else:
        where = origin.get("path", "?")
    dtype = record.get("dtype", "?")
    return CachedModel(record.get("name", entry.name), record.get("arch") or _arch(entry),
                       _format(entry, dtype), _size(entry), where, entry, origin.get("package"))


def _arch(entry: Path) -> str:
    try:
        return json.loads((entry / "config.json").read_text())["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return "?"


def _format(entry: Path, dtype: str) -> str:
    if dtype == HF_FORMAT:
        try:
            torch_dtype = json.loads((entry / "config.json").read_text()).get("torch_dtype")
        except (OSError, ValueError):
            torch_dtype = None
        return f"hf safetensors {torch_dtype or ''}".strip()
    return f"{dtype} {'+'.join(_weight_formats(entry / 'model.safetensors'))}"


def _weight_formats(weights: Path) -> list[str]:
    """The block formats a conversion's matrices are stored in (its safetensors metadata), else float32."""
    from backends.mindspore.modeldir.quant import QUANT_KEY
    from backends.safetensors_reader import ITEMSIZE, SafetensorsFormatError, read_header

    try:
        header = read_header(weights, accepted=ITEMSIZE, cap=64 << 20)
        formats = json.loads(header.metadata.get(QUANT_KEY, "{}")).values()
    except (OSError, ValueError, SafetensorsFormatError):
        return ["?"]
    return sorted(set(formats)) or ["f32"]


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
