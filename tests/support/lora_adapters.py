"""PEFT LoRA adapter directories for tests, written from a fixed seed with non-zero lora_B (PEFT's own
initialisation, B = 0, would change nothing), and ``merged_weights``: W + scale·B@A computed independently of
``backends/lora.py`` (the safetensors library's own parser, this file's own scale and pattern rules).

Magnitudes: each module's delta scale·B@A has entries of standard deviation ``strength`` times the base
weight's (measured from ``base_weights`` when given, else ``DEFAULT_WEIGHT_STD``), so the delta moves the
projection's output by about ``strength`` times its own spread: enough to change greedy text, not enough to
blow up the numbers. SmolLM2-135M's projection weights have std 0.05–0.4 (per layer and projection), so
pass its weights for calibrated adapters. Measured on SmolLM2 with its weights passed, a chat prompt and
strength 1: the delta's output std over the projection's own is 0.65–1.56 (median per projection), logits
stay finite with the base's spread, and the greedy text changes completely (strength 0.1 keeps the base's
greedy tokens, 0.2 changes them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import TensorSpec, deserialize, serialize_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
DEFAULT_WEIGHT_STD = 0.1  # the std of tests/support/tiny_model.py's projection weights
_KEY = re.compile(r"base_model\.model\.(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight")


def make_adapter(out_dir: str | Path, dims: Any, *, seed: int, rank: int = 8, alpha: float = 16,
                 targets: Iterable[str] = PROJECTIONS, use_rslora: bool = False, dtype: str = "float32",
                 rank_pattern: Mapping[str, int] | None = None, alpha_pattern: Mapping[str, float] | None = None,
                 layers: Iterable[int] | None = None, base_weights: Mapping[str, np.ndarray] | None = None,
                 strength: float = 1.0) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` as PEFT saves them
    (``dims``: a BaseDims or anything with its attributes; ``layers``: layers_to_transform, None = all).
    Same arguments → byte-identical files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets, rank_pattern, alpha_pattern = list(targets), dict(rank_pattern or {}), dict(alpha_pattern or {})
    chosen = list(range(dims.num_layers)) if layers is None else sorted(layers)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in chosen:
        for proj in (p for p in PROJECTIONS if p in targets):
            module = f"model.layers.{layer}.{_BLOCK[proj]}.{proj}"
            r = _pattern_value(rank_pattern, module, rank)
            scale = _scale(_pattern_value(alpha_pattern, module, alpha), r, use_rslora)
            in_features, out_features = _shape(dims, proj)
            target_std = strength * (DEFAULT_WEIGHT_STD if base_weights is None
                                     else float(np.std(base_weights[module + ".weight"])))
            # std(scale * B @ A) = scale * sqrt(r) * std(A) * std(B), with std(A) = 1/sqrt(in)
            a = rng.standard_normal((r, in_features)) / math.sqrt(in_features)
            b = rng.standard_normal((out_features, r)) * target_std * math.sqrt(in_features) / (scale * math.sqrt(r))
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
    _write_safetensors(tensors, out / "adapter_model.safetensors", dtype)
    config = _peft_config(rank, alpha, targets, use_rslora, rank_pattern, alpha_pattern, layers)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def merged_weights(base_weights: Mapping[str, np.ndarray], adapter_dir: str | Path) -> dict[str, np.ndarray]:
    """``base_weights`` (HF names, [out, in]) with every adapted projection replaced by W + scale·B@A
    (float64 arithmetic, cast back to W's dtype); the other weights are the same arrays."""
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    factors: dict[str, dict[str, np.ndarray]] = {}
    for key, raw in deserialize((adapter_dir / "adapter_model.safetensors").read_bytes()):
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{key!r} is not a LoRA factor of a Llama layer")
        factors.setdefault(match[1], {})[match[2]] = _decode(raw)
    merged = dict(base_weights)
    for module, pair in factors.items():
        a, b = pair["A"], pair["B"]
        r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        if a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{module}: factors {a.shape} and {b.shape} do not have the config's rank {r}")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        w = base_weights[module + ".weight"]
        merged[module + ".weight"] = (w.astype(np.float64) + _scale(alpha, r, config.get("use_rslora", False))
                                      * (b @ a)).astype(w.dtype)
    return merged


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern rule: the first key (a regex) that matches the end of the module
    name, starting at a dot boundary."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def _scale(alpha: float, r: int, use_rslora: bool) -> float:
    return alpha / r ** 0.5 if use_rslora else alpha / r


def _shape(dims: Any, proj: str) -> tuple[int, int]:
    """(in_features, out_features)."""
    attn_out, kv_out = dims.q_out, dims.kv_out
    return {"q_proj": (dims.hidden, attn_out), "k_proj": (dims.hidden, kv_out), "v_proj": (dims.hidden, kv_out),
            "o_proj": (attn_out, dims.hidden), "gate_proj": (dims.hidden, dims.intermediate),
            "up_proj": (dims.hidden, dims.intermediate), "down_proj": (dims.intermediate, dims.hidden)}[proj]


def _write_safetensors(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """Through the safetensors library, as PEFT's save does; bfloat16 rounded to nearest even by hand."""
    arrays = {k: _encode(v, dtype) for k, v in tensors.items()}
    specs = {k: TensorSpec(dtype=dtype, shape=list(v.shape), data_ptr=v.ctypes.data, data_len=v.nbytes)
             for k, v in arrays.items()}  # `arrays` keeps the buffers alive while serialize_file reads them
    serialize_file(specs, str(path), metadata={"format": "pt"})


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        bits = values.astype("<f4").view("<u4").astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return np.ascontiguousarray(values.astype("<f4" if dtype == "float32" else "<f2"))


def _decode(raw: Mapping[str, Any]) -> np.ndarray:
    data, shape = bytes(raw["data"]), raw["shape"]
    if raw["dtype"] == "BF16":
        return (np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4").astype(np.float64).reshape(shape)
    return np.frombuffer(data, {"F32": "<f4", "F16": "<f2"}[raw["dtype"]]).astype(np.float64).reshape(shape)


def _peft_config(rank: int, alpha: float, targets: list[str], use_rslora: bool, rank_pattern: dict,
                 alpha_pattern: dict, layers: Iterable[int] | None) -> dict[str, Any]:
    """adapter_config.json with the fields PEFT 0.19 writes for a plain LoRA."""
    return {
        "alora_invocation_tokens": None, "alpha_pattern": alpha_pattern, "arrow_config": None, "auto_mapping": None,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "bias": "none", "corda_config": None,
        "ensure_weight_tying": False, "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "layer_replication": None, "layers_pattern": None,
        "layers_to_transform": None if layers is None else sorted(layers), "loftq_config": {}, "lora_alpha": alpha,
        "lora_bias": False, "lora_dropout": 0.0, "lora_ga_config": None, "megatron_config": None,
        "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA", "peft_version": "0.19.1",
        "qalora_group_size": 16, "r": rank, "rank_pattern": rank_pattern, "revision": None,
        "target_modules": sorted(targets), "target_parameters": None, "task_type": "CAUSAL_LM",
        "trainable_token_indices": None, "use_bdlora": None, "use_dora": False, "use_qalora": False,
        "use_rslora": use_rslora,
    }
