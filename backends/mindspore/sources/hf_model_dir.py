"""A Hugging Face model directory (``config.json``, ``tokenizer.json``, ``*.safetensors``) made servable without
touching it: a model directory in the cache holding a copy of its small JSON/tokenizer files and a predict yaml
written from ``config.json`` whose ``load_checkpoint`` points at the user's safetensors (absolute path; the
weights are read from where they are). Text families only (``families/``); what the network does not implement
(rope scaling, a sliding window, outside a family whose reader judges its own) is refused by name."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from backends.mindspore.families import FAMILIES, Family, family_of
from backends.safetensors_reader import ITEMSIZE, SafetensorsFormatError, read_header

# Copied into the cache entry: what the tokenizer and the yaml reader look for beside the yaml.
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


class HfDirError(ValueError):
    """The directory is not an HF model mindserve can serve; the message names the directory and what."""


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def weights_of(path: Path) -> Path:
    """The one ``.safetensors`` file, or the directory when the weights are sharded (the loader merges them)."""
    files = sorted(path.glob("*.safetensors"))
    return files[0] if len(files) == 1 else path


def content_key(path: Path) -> str:
    """sha256 over what the cache entry is made from: the small files' bytes and the weights' names and sizes
    (the weights themselves are read from ``path`` at load, so their bytes are not part of the entry)."""
    digest = hashlib.sha256(str(path.resolve()).encode())
    for name in SMALL_FILES:
        if (path / name).is_file():
            digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        digest.update(f"{weights.name}\0{weights.stat().st_size}".encode())
    return digest.hexdigest()


def write_model_dir(src: Path, out: Path, name: str) -> str:
    """Fill ``out`` (an empty directory) from the HF directory ``src``; the architecture."""
    config = _read_config(src)
    if not (src / "tokenizer.json").is_file():
        raise HfDirError(f"{src}: no tokenizer.json (mindserve reads the fast tokenizer's file)")
    arch = _arch(src, config)
    weights = weights_of(src).resolve()
    model_config = predict_model_config(src, config, arch, _has_head(src))
    for small in SMALL_FILES:
        if (src / small).is_file():
            shutil.copyfile(src / small, out / small)
    tree = {"run_mode": "predict", "load_checkpoint": str(weights), "load_ckpt_format": "safetensors",
            "context": {"mode": 0, "device_target": "CPU"},
            "model": {"arch": {"type": arch}, "model_config": model_config},
            "processor": {"return_tensors": "ms", "tokenizer": {"type": "PreTrainedTokenizerFast",
                                                                 "tokenizer_file": "tokenizer.json"}}}
    header = f"# MindFormers-style predict config written by mindserve from {src}/config.json\n"
    (out / f"predict_{name}.yaml").write_text(header + yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
    return arch


def _read_config(src: Path) -> dict[str, Any]:
    try:
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HfDirError(f"{src}/config.json: cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise HfDirError(f"{src}/config.json: the top level must be an object")
    wrapper = next((f.hf_wrapper for f in FAMILIES if f.hf_wrapper is not None
                    and f.hf_wrapper.model_type == config.get("model_type")), None)
    return config.get("text_config", config) if wrapper is not None else config


def _arch(src: Path, config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else None
    wrapper = next((f.hf_wrapper for f in FAMILIES if f.hf_wrapper is not None and f.hf_wrapper.refused_arch == arch),
                   None)
    if wrapper is not None:
        raise HfDirError(f"{src}/config.json: architectures {arch!r} {wrapper.why}")
    text = [a for f in FAMILIES if not f.capabilities.vision for a in f.archs]
    if arch not in text:
        raise HfDirError(f"{src}/config.json: architectures {archs!r}: mindserve serves an HF directory of "
                         f"{', '.join(text)} (a vision-language model needs its predict yaml: docs/qwen2-vl.md)")
    return arch


def _has_head(src: Path) -> bool:
    """Whether the checkpoint has its own ``lm_head.weight`` (else the head is tied to the embedding)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return "lm_head.weight" in json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    try:
        headers = [read_header(f, accepted=ITEMSIZE, cap=64 << 20) for f in sorted(src.glob("*.safetensors"))]
    except SafetensorsFormatError as exc:
        raise HfDirError(f"{src}: a .safetensors file is not readable: {exc}") from None
    return any("lm_head.weight" in h.tensors for h in headers)


def predict_model_config(src: Path, c: dict[str, Any], arch: str, has_head: bool) -> dict[str, Any]:
    """The predict yaml's ``model.model_config`` from an HF config.json (HF's defaults where a key is absent)."""
    def need(key: str) -> Any:
        if not isinstance(c.get(key), int) or isinstance(c.get(key), bool):
            raise HfDirError(f"{src}/config.json: {key} must be an integer, got {c.get(key)!r}")
        return c[key]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    family = family_of(arch)
    _refuse_unimplemented(src, c, arch, family)
    positions = c.get("max_position_embeddings") or 2048
    mc = {"type": "LlamaConfig", "seq_length": positions, "hidden_size": hidden,
          "num_layers": need("num_hidden_layers"), "num_heads": heads,
          "n_kv_heads": c.get("num_key_value_heads") or heads, "intermediate_size": need("intermediate_size"),
          "vocab_size": need("vocab_size"), "rms_norm_eps": c.get("rms_norm_eps", 1e-6),
          "theta": c.get("rope_theta", 10000.0), "max_position_embedding": positions,
          "qkv_has_bias": bool(c.get("attention_bias", family.defaults.qkv_bias)),
          "tie_word_embeddings": not has_head, "compute_dtype": "float32", "param_init_type": "float32",
          "use_past": True}
    if c.get("head_dim") and c["head_dim"] != hidden // heads:
        mc["head_dim"] = c["head_dim"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if c.get(key) is not None:
            mc[key] = c[key]
    mc.update({k: c[k] for k in family.config_keys if c.get(k) is not None})  # the experts', Gemma 3's keys
    return mc


def _refuse_unimplemented(src: Path, c: dict[str, Any], arch: str, family: Family) -> None:
    if family.capabilities.sliding_window:
        return  # a family with local layers reads its window and rope scaling itself, refusing what it lacks
    scaling = c.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        raise HfDirError(f"{src}/config.json: rope_scaling {scaling!r} is not implemented for {arch}")
    window = c.get("sliding_window")
    if window and c.get("use_sliding_window", True) and window < (c.get("max_position_embeddings") or 0):
        raise HfDirError(f"{src}/config.json: sliding_window {window} is not implemented for {arch} "
                         "(every layer attends to the whole sequence)")
