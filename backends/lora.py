"""LoRA adapters for serving, loaded from PEFT directories (adapter_config.json + adapter_model.safetensors):
the config's rules (``backends/lora_config.py``), then the safetensors header checked by our bounded reader
before any tensor data is read, then each module's factors as float32. NumPy and safetensors only."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO

import numpy as np

from backends.lora_config import (BLOCK, PROJECTIONS, AdapterError, AdapterPlan, BaseDims, module_name,
                                  read_plan)
from backends.safetensors_reader import (Header, SafetensorsFormatError, TensorEntry, read_header,
                                         read_tensor)

__all__ = ["PROJECTIONS", "AdapterError", "BaseDims", "LoraAdapter", "LoraModule", "load_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
# PEFT's saved names; some versions (and state dicts saved by hand) keep the adapter name "default".
_KEY = re.compile(r"base_model\.model\.model\.layers\.(0|[1-9][0-9]*)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_(A|B)(\.default)?\.weight")


@dataclass(frozen=True, slots=True, eq=False)
class LoraModule:
    a: np.ndarray  # lora_A [r, in_features] float32, C-contiguous, read-only
    b: np.ndarray  # lora_B [out_features, r] float32, C-contiguous, read-only
    scale: float  # alpha / r, or alpha / sqrt(r) with use_rslora (rank_pattern/alpha_pattern applied)


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    name: str
    path: Path
    rank: int  # the largest r of its modules
    targets: tuple[str, ...]  # projections it touches, in PROJECTIONS order
    scale: float  # the default (non-pattern) scale
    use_rslora: bool
    modules: Mapping[tuple[int, str], LoraModule]  # (layer index, projection) -> factors

    def info(self) -> dict:
        """What ``/info`` shows of the adapter."""
        return {"name": self.name, "rank": self.rank, "targets": list(self.targets), "scale": self.scale,
                "use_rslora": self.use_rslora}


def load_adapter(name: str, path: Path | str, dims: BaseDims, max_rank: int | None = None) -> LoraAdapter:
    """Load and check the PEFT adapter in directory ``path`` against the base model's ``dims`` (``max_rank``
    None: no rank limit beyond 1024); every failure is an AdapterError naming the adapter, the file and the
    tensor or key."""
    directory = Path(path)
    config_file, weights_file = _files(name, directory)
    plan = read_plan(name, config_file, dims, max_rank)
    factors = _match_tensors(name, weights_file, _header(name, weights_file), plan, dims)
    modules = _read_modules(name, weights_file, factors, plan)
    targets = tuple(p for p in PROJECTIONS if any(proj == p for _, proj in modules))
    rank = max(m.rank for m in plan.modules.values())
    return LoraAdapter(name, directory, rank, targets, plan.scale, plan.use_rslora, MappingProxyType(modules))


def _files(name: str, directory: Path) -> tuple[Path, Path]:
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise AdapterError(name, directory, f"the adapter directory {what}")
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    _regular_file(name, config_file)
    if not weights_file.exists() and (directory / PICKLE_FILE).exists():
        raise AdapterError(name, directory / PICKLE_FILE, f"is a pickle, which is never loaded; convert it to "
                           f"{WEIGHTS_FILE} (see docs/lora.md, 'Converting a .bin')", PICKLE_FILE)
    _regular_file(name, weights_file)
    return config_file, weights_file


def _regular_file(name: str, file: Path) -> None:
    """Present and a regular file (a FIFO or a device would block or never end)."""
    if not file.exists():
        raise AdapterError(name, file, f"missing: a PEFT adapter directory holds {file.name}")
    if not file.is_file():
        raise AdapterError(name, file, "is not a regular file")


def _header(name: str, file: Path) -> Header:
    try:
        return read_header(file)
    except SafetensorsFormatError as exc:
        raise AdapterError(name, file, str(exc), exc.key) from None
    except OSError as exc:
        raise AdapterError(name, file, f"cannot be read: {exc.strerror or exc}") from None


def _match_tensors(name: str, file: Path, header: Header, plan: AdapterPlan,
                   dims: BaseDims) -> dict[tuple[int, str], tuple[TensorEntry, TensorEntry]]:
    """Each targeted module's (lora_A, lora_B) entries, names and shapes checked; nothing else allowed."""
    found: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for key, entry in header.tensors.items():
        module, factor = _module_of(name, file, key, plan, dims)
        slot = found.setdefault(module, {})
        if factor in slot:
            raise AdapterError(name, file, f"tensor {key!r} repeats {slot[factor].name!r}", key)
        slot[factor] = entry
    out = {}
    for module, wanted in plan.modules.items():
        slot = found.get(module, {})
        for factor in "AB":
            if factor not in slot:
                key = _key(module, factor)
                raise AdapterError(name, file, f"tensor {key!r} is missing: adapter_config.json targets "
                                   f"{module_name(*module)}, which needs both lora_A and lora_B", key)
        in_features, out_features = dims.shape(module[1])
        for factor, shape in (("A", (wanted.rank, in_features)), ("B", (out_features, wanted.rank))):
            entry = slot[factor]
            if entry.shape != shape:
                raise AdapterError(name, file, f"tensor {entry.name!r} has shape {list(entry.shape)}, expected "
                                   f"{list(shape)} (lora_A is [r, in_features], lora_B [out_features, r]; r "
                                   f"{wanted.rank} from `{wanted.rank_key}` in adapter_config.json)", entry.name)
        out[module] = (slot["A"], slot["B"])
    return out


def _key(module: tuple[int, str], factor: str) -> str:
    return f"base_model.model.{module_name(*module)}.lora_{factor}.weight"


def _module_of(name: str, file: Path, key: str, plan: AdapterPlan, dims: BaseDims) -> tuple[tuple[int, str], str]:
    """The (layer, projection) and factor ("A" or "B") a tensor name is for, or the reason it is refused."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise AdapterError(name, file, f"tensor {key!r} {_why_unknown(key)}", key)
    layer, block, proj, factor = int(match[1]), match[2], match[3], match[4]
    if BLOCK.get(proj) != block:
        raise AdapterError(name, file, f"tensor {key!r} is for {block}.{proj}, which is not a projection of the "
                           f"base model (supported: {', '.join(PROJECTIONS)})", key)
    if layer >= dims.num_layers:
        raise AdapterError(name, file, f"tensor {key!r} is for layer {layer}, but the base model has "
                           f"{dims.num_layers} layers", key)
    if (layer, proj) not in plan.modules:
        raise AdapterError(name, file, f"tensor {key!r} is for {module_name(layer, proj)}, which "
                           "adapter_config.json does not target (target_modules, layers_to_transform, "
                           "exclude_modules)", key)
    return (layer, proj), factor


def _why_unknown(key: str) -> str:
    if "embed_tokens" in key or "lm_head" in key or "lora_embedding" in key:
        return ("holds embedding or lm_head weights (a resized vocabulary, or LoRA on embeddings), which are "
                "unsupported")
    if "lora_magnitude_vector" in key:
        return "is a DoRA magnitude vector; DoRA is not supported"
    if ".lora_B" in key and key.endswith(".bias"):
        return "is a lora_B bias (lora_bias); it is not supported"
    return ("is not a LoRA factor of the base model (expected base_model.model.model.layers.{i}."
            "{self_attn|mlp}.{projection}.lora_{A|B}.weight)")


def _read_modules(name: str, file: Path, factors: dict[tuple[int, str], tuple[TensorEntry, TensorEntry]],
                  plan: AdapterPlan) -> dict[tuple[int, str], LoraModule]:
    modules = {}
    try:
        with file.open("rb") as f:
            for module in sorted(factors, key=lambda m: (m[0], PROJECTIONS.index(m[1]))):
                a, b = (_finite(name, file, f, entry) for entry in factors[module])
                modules[module] = LoraModule(a, b, plan.modules[module].scale)
    except SafetensorsFormatError as exc:
        raise AdapterError(name, file, str(exc), exc.key) from None
    except OSError as exc:
        raise AdapterError(name, file, f"cannot be read: {exc.strerror or exc}") from None
    return modules


def _finite(name: str, file: Path, f: BinaryIO, entry: TensorEntry) -> np.ndarray:
    array = read_tensor(f, entry)
    bad = ~np.isfinite(array)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        count = int(bad.sum())
        raise AdapterError(name, file, f"tensor {entry.name!r} has {count} non-finite value{'s' * (count > 1)} "
                           f"(NaN or infinity; the first at index {list(first)})", entry.name)
    array.flags.writeable = False
    return array
