"""MindFormers-style predict yaml (with ``base_config`` inheritance) -> frozen ``ModelSpec``."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from backends.types import ModelDefaults

SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "ParallelLlamaForCausalLM")
VL_ARCHS = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")  # qwen2_vl/config.py
DEVICE_TARGETS = ("CPU", "GPU", "Ascend")
_MAX_BASE_DEPTH = 8
# model_config.weight_dtype: float32, a GGUF block format kept by convert-gguf (served by the quantized AOT
# matmul, dequantized once at load for the stock ops), or mixed (the layers' matrices differ).
WEIGHT_DTYPES = ("float32", "q8_0", "q4_0", "q4_1", "mixed")


class ConfigError(ValueError):
    """A model config is missing, malformed, or names something we cannot run."""

    def __init__(self, path: Path | str, key: str, message: str) -> None:
        super().__init__(f"{path}: {key}: {message}")
        self.path, self.key = str(path), key


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the network, tokenizer and engine need from a model directory."""

    yaml_path: Path
    model_dir: Path
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    seq_length: int
    qkv_has_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    compute_dtype: str
    checkpoint: Path
    checkpoint_format: str  # "safetensors" | "ckpt"
    tokenizer: dict[str, Any]
    mode: int  # 0 = GRAPH_MODE, 1 = PYNATIVE_MODE
    device_target: str
    defaults: ModelDefaults
    config_vocab_size: int | None  # config.json vocab_size / padded_vocab_size (for top_k clamp)
    weight_dtype: str = "float32"  # model_config.weight_dtype: how the layers' matrices are stored (WEIGHT_DTYPES)


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


class _Section:
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


def _eos_ids(value: Any, path: Path) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(path, "model.model_config.eos_token_id", f"must be an int or list of ints, got {value!r}")
    return tuple(ids)


def _read_hf_config(model_dir: Path) -> dict:
    return read_json_object(model_dir / "config.json")


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


def _intermediate_size(mc: _Section, hidden: int) -> int:
    """``intermediate_size``, else derived as MindFormers' LlamaConfig does (Llama-2 yamls give only
    ``multiple_of``): 2/3 of 4*hidden, times ``ffn_dim_multiplier``, rounded up to ``multiple_of``."""
    size = mc.positive("intermediate_size", None)
    if size is not None:
        return size
    multiple_of = mc.positive("multiple_of", 256)
    size = int(2 * 4 * hidden / 3)
    multiplier = mc.get("ffn_dim_multiplier", float, None)
    if multiplier is not None:
        size = int(multiplier * size)
    return multiple_of * -(-size // multiple_of)


def _defaults(mc: _Section) -> ModelDefaults:
    return ModelDefaults(
        do_sample=mc.get("do_sample", bool, None),
        temperature=mc.get("temperature", float, None),
        top_k=mc.get("top_k", int, None) or None,  # 0 = off, as in MindFormers and HF
        top_p=mc.get("top_p", float, None),
        repetition_penalty=mc.get("repetition_penalty", float, None),
    )


def _checkpoint(tree: dict, yaml_path: Path) -> tuple[Path, str]:
    raw = tree.get("load_checkpoint") or ""
    if not isinstance(raw, str):
        raise ConfigError(yaml_path, "load_checkpoint", f"must be a path, got {raw!r}")
    ckpt = (yaml_path.parent / raw) if raw else yaml_path.parent / "model.safetensors"
    fmt = tree.get("load_ckpt_format") or ("ckpt" if ckpt.suffix == ".ckpt" else "safetensors")
    if fmt not in ("safetensors", "ckpt"):
        raise ConfigError(yaml_path, "load_ckpt_format", f"must be safetensors or ckpt, got {fmt!r}")
    return ckpt, fmt


def _context(tree: dict, yaml_path: Path) -> tuple[int, str]:
    ctx = _Section(yaml_path, "context", tree.get("context") or {})
    mode = ctx.get("mode", int, 0)
    if mode not in (0, 1):
        raise ConfigError(yaml_path, "context.mode", f"must be 0 (GRAPH_MODE) or 1 (PYNATIVE_MODE), got {mode}")
    target = ctx.get("device_target", str, "CPU")
    if target not in DEVICE_TARGETS:
        raise ConfigError(yaml_path, "context.device_target", f"must be CPU, GPU or Ascend, got {target!r}")
    return mode, target


def load_model_spec(path: Path | str) -> ModelSpec:
    """Read a model directory (or one yaml inside it) into a ``ModelSpec``; for a vision-language arch
    (``qwen2_vl.config``), its language model's."""
    path = Path(path)
    yaml_path = find_model_yaml(path) if path.is_dir() else path
    tree = load_yaml_tree(yaml_path)
    model = _Section(yaml_path, "model", tree.get("model"))
    arch = _Section(yaml_path, "model.arch", model.get("arch", dict)).get("type", str)
    if arch in VL_ARCHS:
        from backends.mindspore.qwen2_vl.config import load_vl_spec

        return load_vl_spec(yaml_path).text
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(yaml_path, "model.arch.type",
                          f"{arch!r} is not supported; use one of {SUPPORTED_ARCHS + VL_ARCHS}")
    mc = _Section(yaml_path, "model.model_config", model.get("model_config", dict))
    hidden, heads = mc.positive("hidden_size"), mc.positive("num_heads")
    kv_heads = mc.positive("n_kv_heads", heads, "num_key_value_heads")
    head_dim = mc.positive("head_dim", None)
    if head_dim is None and hidden % heads:
        raise ConfigError(yaml_path, "model.model_config.num_heads",
                          f"num_heads {heads} does not divide hidden_size {hidden}")
    if heads % kv_heads:
        raise ConfigError(yaml_path, "model.model_config.n_kv_heads",
                          f"n_kv_heads {kv_heads} does not divide num_heads {heads}")
    seq_length = mc.positive("seq_length", 2048)
    hf = _read_hf_config(yaml_path.parent)
    cfg_vocab = hf.get("vocab_size") or hf.get("padded_vocab_size")
    if isinstance(cfg_vocab, bool):
        cfg_vocab = None
    ckpt, fmt = _checkpoint(tree, yaml_path)
    mode, target = _context(tree, yaml_path)
    tok = _Section(yaml_path, "processor", tree.get("processor") or {}).get("tokenizer", dict, {})
    dtype = mc.get("compute_dtype", str, "float32")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError(yaml_path, "model.model_config.compute_dtype", f"unknown dtype {dtype!r}")
    weight_dtype = mc.get("weight_dtype", str, "float32")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(yaml_path, "model.model_config.weight_dtype",
                          f"must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    return ModelSpec(
        yaml_path=yaml_path, model_dir=yaml_path.parent, arch=arch,
        hidden_size=hidden, num_layers=mc.positive("num_layers", ..., "num_hidden_layers"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
        intermediate_size=_intermediate_size(mc, hidden),
        vocab_size=mc.positive("vocab_size"),
        rms_norm_eps=mc.get("rms_norm_eps", float, 1e-6),
        rope_theta=mc.get("theta", float, 10000.0, "rope_theta"),
        max_position_embeddings=mc.positive("max_position_embedding", seq_length, "max_position_embeddings"),
        seq_length=seq_length,
        qkv_has_bias=mc.get("qkv_has_bias", bool, arch == "Qwen2ForCausalLM"),
        tie_word_embeddings=mc.get("tie_word_embeddings", bool, False),
        bos_token_id=mc.get("bos_token_id", int, None),
        eos_token_ids=_eos_ids(mc.get("eos_token_id", (int, list), 2), yaml_path),
        pad_token_id=mc.get("pad_token_id", int, None),
        compute_dtype=dtype, checkpoint=ckpt, checkpoint_format=fmt,
        tokenizer=tok, mode=mode, device_target=target,
        defaults=_defaults(mc),
        config_vocab_size=cfg_vocab if isinstance(cfg_vocab, int) and cfg_vocab > 0 else None,
        weight_dtype=weight_dtype,
    )
