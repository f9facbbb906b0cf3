"""The yaml-tree reader both model families share: a MindFormers-style predict yaml with its
``base_config`` chain, typed reads whose errors name the file and the dotted key, and the readers of the
keys every family has (checkpoint, context, sampling defaults, EOS ids)."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import yaml

from backends.types import ModelDefaults

DEVICE_TARGETS = ("CPU", "GPU", "Ascend")
_MAX_BASE_DEPTH = 8


class ConfigError(ValueError):
    """A model config is missing, malformed, or names something we cannot run."""

    def __init__(self, path: Path | str, key: str, message: str) -> None:
        super().__init__(f"{path}: {key}: {message}")
        self.path, self.key = str(path), key


def deep_merge(base: dict, child: dict) -> dict:
    """Return ``base`` with ``child`` merged over it; nested dicts merge, child wins."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_yaml_tree(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Load a yaml and its ``base_config`` chain: bases in list order, then the child deep-merged."""
    here = Path(os.path.abspath(path))
    if here in _chain:
        cycle = " -> ".join(p.name for p in (*_chain, here))
        raise ConfigError(path, "base_config", f"inheritance cycle: {cycle}")
    if len(_chain) > _MAX_BASE_DEPTH:
        raise ConfigError(path, "base_config", f"inheritance deeper than {_MAX_BASE_DEPTH}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(path, "<file>", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, "<file>", f"cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, "<yaml>", f"not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, "<root>", f"must be a mapping, got {type(data).__name__}")
    bases = data.pop("base_config", None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(path, "base_config", f"must be a path or a list of paths, got {bases!r}")
    merged: dict = {}
    for base in bases:
        merged.update(load_yaml_tree(path.parent / base, (*_chain, here)))
    return deep_merge(merged, data)


def find_model_yaml(model_dir: Path) -> Path:
    """The predict yaml of a model directory (exactly one ``*.yaml``, as MindIE requires)."""
    if not model_dir.is_dir():
        raise ConfigError(model_dir, "modelWeightPath", "is not a directory")
    yamls = sorted(p for p in model_dir.iterdir() if p.suffix in (".yaml", ".yml"))
    if len(yamls) != 1:
        names = [p.name for p in yamls]
        raise ConfigError(model_dir, "<yaml>", f"expected exactly one .yaml file, found {names}")
    return yamls[0]


class YamlSection:
    """Typed reads from one mapping, with errors that name file and dotted key."""

    def __init__(self, path: Path, prefix: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise ConfigError(path, prefix, f"must be a mapping, got {data!r}")
        self.path, self.prefix, self.data = path, prefix, data

    def get(self, key: str, kind: type | tuple, default: Any = ..., *alts: str) -> Any:
        for name in (key, *alts):
            if self.data.get(name) is not None:
                value = self.data[name]
                break
        else:
            if default is ...:
                raise ConfigError(self.path, f"{self.prefix}.{key}", "is required")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and kind in (int, float):
            raise ConfigError(self.path, f"{self.prefix}.{key}", f"must be {kind.__name__}, got {value!r}")
        if not isinstance(value, kind):
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise ConfigError(self.path, f"{self.prefix}.{key}", f"must be {want}, got {value!r}")
        return value

    def positive(self, key: str, default: Any = ..., *alts: str) -> int:
        value = self.get(key, int, default, *alts)
        if value is not None and value <= 0:
            raise ConfigError(self.path, f"{self.prefix}.{key}", f"must be > 0, got {value}")
        return value


def read_json_object(path: Path) -> dict:
    """A JSON file of the model directory that holds an object ({} when absent); ConfigError naming the file
    when it is not valid JSON or not an object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(path, "<json>", f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, "<root>", f"must be an object, got {type(data).__name__}")
    return data


def read_eos_ids(value: Any, path: Path) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(path, "model.model_config.eos_token_id", f"must be an int or list of ints, got {value!r}")
    return tuple(ids)


def read_defaults(mc: YamlSection) -> ModelDefaults:
    return ModelDefaults(
        do_sample=mc.get("do_sample", bool, None),
        temperature=mc.get("temperature", float, None),
        top_k=mc.get("top_k", int, None) or None,  # 0 = off, as in MindFormers and HF
        top_p=mc.get("top_p", float, None),
        repetition_penalty=mc.get("repetition_penalty", float, None),
    )


def read_checkpoint(tree: dict, yaml_path: Path) -> tuple[Path, str]:
    raw = tree.get("load_checkpoint") or ""
    if not isinstance(raw, str):
        raise ConfigError(yaml_path, "load_checkpoint", f"must be a path, got {raw!r}")
    ckpt = (yaml_path.parent / raw) if raw else yaml_path.parent / "model.safetensors"
    fmt = tree.get("load_ckpt_format") or ("ckpt" if ckpt.suffix == ".ckpt" else "safetensors")
    if fmt not in ("safetensors", "ckpt"):
        raise ConfigError(yaml_path, "load_ckpt_format", f"must be safetensors or ckpt, got {fmt!r}")
    return ckpt, fmt


def read_context(tree: dict, yaml_path: Path) -> tuple[int, str]:
    ctx = YamlSection(yaml_path, "context", tree.get("context") or {})
    mode = ctx.get("mode", int, 0)
    if mode not in (0, 1):
        raise ConfigError(yaml_path, "context.mode", f"must be 0 (GRAPH_MODE) or 1 (PYNATIVE_MODE), got {mode}")
    target = ctx.get("device_target", str, "CPU")
    if target not in DEVICE_TARGETS:
        raise ConfigError(yaml_path, "context.device_target", f"must be CPU, GPU or Ascend, got {target!r}")
    return mode, target


def read_model_yaml(path: Path | str) -> tuple[Path, dict, YamlSection, str]:
    """A model directory (or one yaml inside it): its yaml's path, the merged tree, the ``model`` section
    and ``model.arch.type``."""
    path = Path(path)
    yaml_path = find_model_yaml(path) if path.is_dir() else path
    tree = load_yaml_tree(yaml_path)
    model = YamlSection(yaml_path, "model", tree.get("model"))
    arch = YamlSection(yaml_path, "model.arch", model.get("arch", dict)).get("type", str)
    return yaml_path, tree, model, arch


@functools.cache
def torch_dtype(model_dir: Path) -> str | None:
    """config.json's ``torch_dtype`` (what /info reports as the model dtype), None if absent."""
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
