"""GGUF → model directory: config.json, tokenizer files, model.safetensors, predict yaml, for the architectures
of ``gguf_archs.py`` (llama, qwen2, qwen3, qwen3moe; any other is refused by name before any work). A routed-experts
tensor (``ffn_gate_exps`` [E, F, C] ...) becomes the E per-expert matrices of HF's layout
(``mlp.experts.{e}.gate_proj.weight``), each stored like any matrix.

``dtype`` chooses how the matrices are stored (``DTYPES``): ``fp32`` dequantises everything with the `gguf`
package; ``as-shipped`` keeps GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks as they are (uint8
tensors of GGUF rows, ``[rows, row bytes]``; other block formats become Q8_0, float tensors stay float32);
``q8_0`` stores every matrix as Q8_0 (Q8_0 blocks kept, the others dequantised and requantised from the source).
The safetensors metadata key ``mindserve.quantization`` maps each quantized tensor to its format, and the predict yaml's
``model.model_config.weight_dtype`` says what the layers' matrices are (``float32``, a format, or ``mixed``).
Norm weights are always float32. llama.cpp's Q/K row permutation (``llama`` only) is undone (whole rows, so
blocks too).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file
from tqdm import tqdm

from backends.file_lock import directory_lock
from backends.mindspore.families import family_of
from backends.mindspore.sources.gguf_tokenizer import build_tokenizer, special_ids, tokenizer_config
from backends.mindspore.sources.gguf_archs import GGUF_ARCHS, arch_of_model_type, gguf_arch, head_dim
from backends.mindspore.modeldir.quant import QUANT_KEY, layers_format

log = logging.getLogger("mindserve.model")

MARKER = "conversion.json"
# Bump when the converter's output changes, so old conversions are redone (2: as-shipped keeps Q5 and K-quant blocks).
FORMAT_VERSION = 2
DTYPES = ("fp32", "q8_0", "as-shipped")
_KEPT = {GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1",
         GGMLQuantizationType.Q5_0: "q5_0", GGMLQuantizationType.Q5_1: "q5_1", GGMLQuantizationType.Q4_K: "q4_k",
         GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k"}
_FLOAT = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "model.safetensors")

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate"}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                 model_name: str | None = None, progress: bool = True, dtype: str = "fp32") -> Path:
    """Convert `gguf_path` into `out_dir` with its matrices as `dtype` (``DTYPES``); a no-op if out_dir
    already holds this conversion."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    if is_complete_conversion(out_dir, gguf_path, model_name=model_name, dtype=dtype):
        log.info("%s already holds a conversion of %s", out_dir, gguf_path.name)
        return out_dir
    _check_replaceable(out_dir)
    name = model_name or _sanitize(gguf_path.name.removesuffix(".gguf"))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with directory_lock(out_dir.parent, f"converting into {out_dir.name}"):  # one converter at a time
        if is_complete_conversion(out_dir, gguf_path, model_name=model_name, dtype=dtype):
            log.info("another process converted %s into %s meanwhile", gguf_path.name, out_dir)
            return out_dir
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
        try:
            os.chmod(tmp, 0o755)
            log.info("converting %s -> %s", gguf_path, out_dir)
            _convert_into(gguf_path, tmp, name, progress, dtype)
            _write_json(tmp / MARKER, {**_fingerprint(gguf_path), "model_name": name, "dtype": dtype,
                                       "format_version": FORMAT_VERSION,
                                       "files": [*_FILES, f"predict_{name}.yaml"]})
            _install(tmp, out_dir, gguf_path, name, dtype)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_complete_conversion(out_dir: Path, gguf_path: Path | None = None, *,
                           model_name: str | None = None, dtype: str | None = None) -> bool:
    """True if out_dir has a finished conversion (of gguf_path, and to dtype, when given; a marker without a
    dtype is an fp32 conversion)."""
    try:
        marker = json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format_version") != FORMAT_VERSION:
        return False
    if model_name is not None and marker.get("model_name") != model_name:
        return False
    if dtype is not None and marker.get("dtype", "fp32") != dtype:
        return False
    if not all((Path(out_dir) / f).is_file() for f in marker.get("files", [])):
        return False
    return gguf_path is None or _same_source(marker, Path(gguf_path))


def unpermute_qk_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: GGUF interleaved-RoPE rows → HF rotate_half rows."""
    # HF's rotate_half pairs row i with row i + hd/2 of each head; llama.cpp's "normal" RoPE
    # pairs rows 2i and 2i+1. Its converter therefore moved HF row (half h, index i) to GGUF
    # row 2*i + h. Viewing GGUF rows as [head, i, h] and swapping to [head, h, i] restores HF.
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_into(gguf_path: Path, out: Path, name: str, progress: bool, dtype: str = "fp32") -> None:
    reader = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    config = _hf_config(meta, reader)  # validates the architecture before any heavy work
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta, config))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"]})
    formats = _write_weights(reader, config, out / "model.safetensors", progress, dtype)
    header = (f"# MindFormers-style predict config written by mindserve from {gguf_path.name}"
              f" (convert-gguf --dtype {dtype})\n")
    (out / f"predict_{name}.yaml").write_text(
        header + yaml.safe_dump(_predict_yaml(config, layers_format(formats), _has_head_norms(reader)),
                                sort_keys=False))


def _hf_config(meta: dict[str, Any], reader: GGUFReader) -> dict[str, Any]:
    arch = gguf_arch(meta)

    def key(name: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch.name}.{name}")
        if value is None and default is ...:
            raise ValueError(f"GGUF metadata {arch.name}.{name} is missing")
        return default if value is None else value

    names = {t.name: t for t in reader.tensors}
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    ids = special_ids(meta)
    eos = [i for i in dict.fromkeys([ids["eos"], ids["eot"]]) if i is not None]
    config = {
        "architectures": [arch.hf_arch], "model_type": arch.model_type,
        "hidden_size": hidden, "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim(meta, arch, hidden, heads),
        "vocab_size": int(names["token_embd.weight"].shape[1]),
        "max_position_embeddings": int(key("context_length")),
        "rope_theta": _f32_repr(key("rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32_repr(key("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": ids["bos"], "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": ids["pad"], "torch_dtype": "float32", "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": False,
        **_moe_config(key, names),
    }
    if arch.config is not None:  # the family's own keys (Gemma 3's layer pattern and attention)
        config.update(arch.config(meta, config["num_hidden_layers"], hidden, heads, config["head_dim"]))
    return config


def _moe_config(key, names: dict[str, Any]) -> dict[str, Any]:
    """HF Qwen3MoeConfig's expert keys from ``<arch>.expert_*`` (none for a dense file). llama.cpp routes with
    normalised top-k weights (qwen3moe) and gives every block with a router (``ffn_gate_inp``) experts; a block
    without one keeps a dense MLP (``mlp_only_layers``)."""
    experts = int(key("expert_count", 0))
    if not experts:
        return {}
    blocks = int(key("block_count"))
    return {"num_experts": experts, "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length")), "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(blocks) if f"blk.{i}.ffn_gate_inp.weight" not in names]}


def _f32_repr(value: float) -> float:
    # GGUF stores float32; 1e-5 reads back as 9.999999747e-06. Keep the shortest decimal
    # that round-trips through float32 (1e-05), as the original HF config has.
    return float(str(np.float32(value)))


def _write_weights(reader: GGUFReader, config: dict[str, Any], path: Path, progress: bool,
                   dtype: str = "fp32") -> dict[str, str]:
    """Write model.safetensors; returns {HF name: storage format} (``float32`` or a block format)."""
    arch = arch_of_model_type(config["model_type"])
    permuted = arch.permuted_qk
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]} if permuted else {}
    weights: dict[str, np.ndarray] = {}
    formats: dict[str, str] = {}
    for t in tqdm(reader.tensors, desc="convert", unit="tensor", file=sys.stderr, disable=not progress):
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost-first
        if len(shape) == 3:  # routed experts [E, out, in]: one HF matrix per expert
            for name, w, fmt in _expert_matrices(t, shape, dtype):
                weights[name], formats[name] = w, fmt
            continue
        fmt = _storage_format(t.tensor_type, shape, dtype)
        if t.name.endswith(".ffn_gate_inp.weight") and t.tensor_type in _FLOAT:
            fmt = "float32"  # a router stays float (llama.cpp's quantizations keep it F32 too): it picks the experts
        if fmt in _KEPT.values() and _KEPT.get(t.tensor_type) == fmt:
            w = np.asarray(t.data, dtype=np.uint8).reshape(shape[0], -1)  # the GGUF blocks, row by row
        else:
            w = dequantize(t.data, t.tensor_type).reshape(shape)
            if fmt == "q8_0":
                w = quantize(np.asarray(w, dtype=np.float32), GGMLQuantizationType.Q8_0).reshape(shape[0], -1)
        kind = t.name.split(".")[-2]
        if t.name.startswith("blk.") and kind in heads:
            w = unpermute_qk_rows(w, heads[kind])  # whole rows: the same for blocks and floats
        name = hf_tensor_name(t.name, arch.name)
        if arch.norm_shift and name.endswith("norm.weight"):  # llama.cpp's 1 + w back to HF's w (exact in float32)
            w = np.asarray(w, np.float32) - np.float32(arch.norm_shift)
        weights[name] = np.array(w, dtype=np.float32 if fmt == "float32" else np.uint8, order="C")  # own copy
        formats[name] = fmt
        del w
    quantized = {k: v for k, v in formats.items() if v != "float32"}
    save_file(weights, str(path), metadata={"format": "pt", QUANT_KEY: json.dumps(quantized, sort_keys=True)})
    os.chmod(path, 0o644)
    return formats


def _expert_matrices(t, shape: tuple[int, int, int], dtype: str):
    """(HF name, array, storage format) of each expert's [out, in] matrix of a 3-D ``blk.N.ffn_*_exps`` tensor, stored
    as ``_storage_format`` says for one such matrix."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
    if m is None or m[2] not in _EXPERT_NAMES:
        raise ValueError(f"unsupported GGUF tensor {t.name!r} of shape {list(shape)}")
    experts, rows, cols = shape
    fmt = _storage_format(t.tensor_type, (rows, cols), dtype)
    if fmt in _KEPT.values() and _KEPT.get(t.tensor_type) == fmt:
        stack = np.asarray(t.data, dtype=np.uint8).reshape(experts, rows, -1)  # each expert's GGUF rows of blocks
    else:
        stack = dequantize(t.data, t.tensor_type).reshape(shape)
    for e in range(experts):
        w = stack[e]
        if fmt == "q8_0" and w.dtype != np.uint8:
            w = quantize(np.asarray(w, dtype=np.float32), GGMLQuantizationType.Q8_0).reshape(rows, -1)
        yield (f"model.layers.{m[1]}.mlp.experts.{e}.{_EXPERT_NAMES[m[2]]}.weight",
               np.array(w, dtype=np.float32 if fmt == "float32" else np.uint8, order="C"), fmt)


def _storage_format(kind: GGMLQuantizationType, shape: tuple[int, ...], dtype: str) -> str:
    """How one tensor is stored: ``float32`` or a block format (see the module docstring). Vectors, and rows
    that are not whole blocks of 32, stay float32."""
    if len(shape) != 2 or shape[1] % 32 or dtype == "fp32":
        return "float32"
    if dtype == "q8_0":
        return "q8_0"
    if kind in _KEPT:
        return _KEPT[kind]
    return "float32" if kind in _FLOAT else "q8_0"


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a GGUF tensor name (of GGUF architecture ``arch``) to its HF transformers parameter name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **dict(GGUF_ARCHS[arch].renames)}
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None or m[2] not in names:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"


def _has_head_norms(reader: GGUFReader) -> bool:
    """Whether the layers have q/k head norms (Qwen3's ``attn_q_norm``; HF's config has no key for them)."""
    return any(t.name == "blk.0.attn_q_norm.weight" for t in reader.tensors)


def _predict_yaml(c: dict[str, Any], weight_dtype: str = "float32", qk_norm: bool = False) -> dict[str, Any]:
    model_config = {
        "type": "LlamaConfig", "seq_length": c["max_position_embeddings"],
        "hidden_size": c["hidden_size"], "num_layers": c["num_hidden_layers"],
        "num_heads": c["num_attention_heads"], "n_kv_heads": c["num_key_value_heads"],
        "intermediate_size": c["intermediate_size"], "vocab_size": c["vocab_size"],
        "rms_norm_eps": c["rms_norm_eps"], "theta": c["rope_theta"],
        "max_position_embedding": c["max_position_embeddings"], "qkv_has_bias": c["attention_bias"],
        "tie_word_embeddings": c["tie_word_embeddings"], "bos_token_id": c["bos_token_id"],
        "eos_token_id": c["eos_token_id"], "pad_token_id": c["pad_token_id"],
        "compute_dtype": "float32", "param_init_type": "float32", "use_past": True,
        **({} if weight_dtype == "float32" else {"weight_dtype": weight_dtype}),  # absent means float32
    }
    # Written only where they differ from the defaults, so a llama conversion's yaml stays what it was.
    if c["head_dim"] != c["hidden_size"] // c["num_attention_heads"]:
        model_config["head_dim"] = c["head_dim"]
    if qk_norm:
        model_config["qk_layernorm"] = True
    family = family_of(c["architectures"][0])  # its own keys: the experts', Gemma 3's layer pattern
    model_config.update({k: c[k] for k in family.config_keys if c.get(k) is not None})
    return {
        "run_mode": "predict", "load_checkpoint": "model.safetensors",
        "load_ckpt_format": "safetensors", "context": {"mode": 0, "device_target": "CPU"},
        "model": {"arch": {"type": c["architectures"][0]}, "model_config": model_config},
        "processor": {"return_tensors": "ms", "tokenizer": {
            "type": "PreTrainedTokenizerFast", "tokenizer_file": "tokenizer.json"}},
    }


def _fingerprint(gguf_path: Path) -> dict[str, Any]:
    st = gguf_path.stat()
    return {"gguf_name": gguf_path.name, "gguf_size": st.st_size, "gguf_mtime_ns": st.st_mtime_ns,
            "gguf_sha256": _sha256(gguf_path)}


def _same_source(marker: dict[str, Any], gguf_path: Path) -> bool:
    """Size+mtime match is trusted; on an mtime change (e.g. re-extracted), compare sha256."""
    try:
        st = gguf_path.stat()
    except OSError:
        return False
    if st.st_size != marker.get("gguf_size"):
        return False
    return st.st_mtime_ns == marker.get("gguf_mtime_ns") or \
        _sha256(gguf_path) == marker.get("gguf_sha256")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise FileExistsError(f"{out_dir} exists and is not a mindserve GGUF conversion; "
                              "refusing to replace it")


def _install(tmp: Path, out_dir: Path, gguf_path: Path, name: str, dtype: str = "fp32") -> None:
    """Move the finished tmp dir into place (a stale conversion is moved aside, then deleted)."""
    if is_complete_conversion(out_dir, gguf_path, model_name=name, dtype=dtype):
        log.info("another process finished converting %s first", out_dir)
        return
    _check_replaceable(out_dir)
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _sanitize(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower() or "model"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
