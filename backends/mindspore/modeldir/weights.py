"""Weights in, weights out: HF safetensors and MindSpore .ckpt (MindFormers names), as HF-named numpy arrays
(float32), or ``QuantWeight`` for the GGUF-block tensors of a quantized conversion (``gguf_convert``: the
safetensors metadata key ``mindserve.quantization`` names them and their formats)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from backends.mindspore.modeldir.quant import QUANT_KEY, QuantError, QuantWeight, layers_format

Weights = dict[str, "np.ndarray | QuantWeight"]

# HF name <-> MindFormers (legacy Llama) name. Shapes are identical ([out, in] for linears).
_NAMES = (
    ("model.embed_tokens.weight", "model.tok_embeddings.embedding_weight"),
    ("model.norm.weight", "model.norm_out.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("model.layers.{n}.self_attn.q_proj.{p}", "model.layers.{n}.attention.wq.{p}"),
    ("model.layers.{n}.self_attn.k_proj.{p}", "model.layers.{n}.attention.wk.{p}"),
    ("model.layers.{n}.self_attn.v_proj.{p}", "model.layers.{n}.attention.wv.{p}"),
    ("model.layers.{n}.self_attn.o_proj.{p}", "model.layers.{n}.attention.wo.{p}"),
    ("model.layers.{n}.mlp.gate_proj.weight", "model.layers.{n}.feed_forward.w1.weight"),
    ("model.layers.{n}.mlp.down_proj.weight", "model.layers.{n}.feed_forward.w2.weight"),
    ("model.layers.{n}.mlp.up_proj.weight", "model.layers.{n}.feed_forward.w3.weight"),
    ("model.layers.{n}.input_layernorm.weight", "model.layers.{n}.attention_norm.weight"),
    ("model.layers.{n}.post_attention_layernorm.weight", "model.layers.{n}.ffn_norm.weight"),
)


class WeightsError(ValueError):
    pass


def _pattern(template: str) -> re.Pattern:
    regex = re.escape(template).replace(r"\{n\}", r"(?P<n>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(regex)


def _rename(name: str, forward: bool) -> str:
    for hf, mf in _NAMES:
        src, dst = (hf, mf) if forward else (mf, hf)
        match = _pattern(src).fullmatch(name)
        if match:
            return dst.format(**match.groupdict())
    raise WeightsError(f"unknown parameter name {name!r}")


def hf_to_mindformers(name: str) -> str:
    return _rename(name, forward=True)


def mindformers_to_hf(name: str) -> str:
    return _rename(name, forward=False)


def load_safetensors(path: Path) -> Weights:
    if not path.exists():
        raise WeightsError(f"{path}: no such weights file")
    tensors = _map_safetensors(path)
    quantized = _quantized_names(path)
    out: Weights = {}
    for name, value in tensors.items():
        out[name] = (_quant_weight(path, name, quantized[name], value) if name in quantized
                     else np.ascontiguousarray(value, dtype=np.float32))
    return out


_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
              "U8": "u1", "BOOL": "?"}


def _map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The file's tensors as read-only views of one memory map of it (8-byte header size, JSON header, data): the
    bytes come from the page cache as they are read, nothing is copied (safetensors' ``load_file`` copies the whole
    file: 1.4-2.0 s of CPU for 1 GB against 0.2-0.3 s). A bfloat16 tensor (how most HF checkpoints ship; NumPy has no
    such type) is widened to float32 here: its 16 bits are the top half of the float32's, exactly."""
    data = np.memmap(path, np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    size = int.from_bytes(bytes(data[:8]), "little") if data.size >= 8 else -1
    try:
        if not 0 < size <= data.size - 8:
            raise ValueError(f"a header of {size} bytes in a file of {data.size}")
        header = json.loads(bytes(data[8:8 + size]))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES and info["dtype"] != "BF16":
                raise ValueError(f"{name}: dtype {info['dtype']!r} is not one of BF16, {', '.join(_ST_DTYPES)}")
            bf16 = info["dtype"] == "BF16"
            dtype = np.dtype("<u2" if bf16 else _ST_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            start, end = (8 + size + int(o) for o in info["data_offsets"])
            if end - start != int(np.prod(shape)) * dtype.itemsize or not 8 + size <= start <= end <= data.size:
                raise ValueError(f"{name}: data_offsets {info['data_offsets']} do not hold {info['dtype']} {shape}")
            out[name] = data[start:end].view(dtype).reshape(shape)
            if bf16:
                out[name] = (out[name].astype(np.uint32) << 16).view(np.float32)
        return out
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"{path}: not a safetensors file: {exc}") from None


def _quantized_names(path: Path) -> dict[str, str]:
    """{tensor name: block format} from the file's metadata (empty for a plain float file)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        raw = (f.metadata() or {}).get(QUANT_KEY)
    if not raw:
        return {}
    try:
        names = json.loads(raw)
    except ValueError:
        names = None
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
        raise WeightsError(f"{path}: metadata {QUANT_KEY} must be a JSON object of tensor name -> format, "
                           f"got {raw[:80]!r}")
    return names


def _quant_weight(path: Path, name: str, fmt: str, blocks: np.ndarray) -> QuantWeight:
    from backends.mindspore.modeldir.quant import BLOCK_BYTES, cols_of

    if blocks.dtype != np.uint8 or blocks.ndim != 2 or fmt not in BLOCK_BYTES or blocks.shape[1] % BLOCK_BYTES[fmt]:
        raise WeightsError(f"{path}: {name}: {fmt} blocks must be uint8 [rows, k * {BLOCK_BYTES.get(fmt, '?')}], "
                           f"got {blocks.dtype} {list(blocks.shape)}")
    try:
        return QuantWeight(fmt, blocks.shape[0], cols_of(fmt, blocks.shape[1]),
                           np.ascontiguousarray(blocks))
    except QuantError as exc:
        raise WeightsError(f"{path}: {name}: {exc}") from None


def weights_format(weights: Weights) -> str:
    """What the layers' matrices are: ``float32``, one block format, or ``mixed`` (the yaml's weight_dtype)."""
    return layers_format({name: w.fmt if isinstance(w, QuantWeight) else "float32" for name, w in weights.items()})


def load_ckpt(path: Path) -> dict[str, np.ndarray]:
    """A MindSpore checkpoint with MindFormers parameter names, returned with HF names."""
    import mindspore as ms

    if not path.is_file():
        raise WeightsError(f"{path}: no such checkpoint file")
    try:
        params = ms.load_checkpoint(str(path))
    except ValueError as exc:
        raise WeightsError(f"{path}: not a MindSpore checkpoint: {exc}") from None
    out = {}
    for name, param in params.items():
        if name.startswith(("adam_", "global_step", "learning_rate", "scale_sense")):
            continue  # training state that MindFormers checkpoints may carry
        try:
            out[mindformers_to_hf(name)] = param.asnumpy().astype(np.float32)
        except WeightsError as exc:
            raise WeightsError(f"{path}: {exc}") from None
    return out


def save_ckpt(weights: dict[str, np.ndarray], path: Path) -> None:
    """Write HF-named arrays as a MindSpore checkpoint with MindFormers names."""
    import mindspore as ms

    items = [{"name": hf_to_mindformers(k), "data": ms.Tensor(v)} for k, v in weights.items()]
    ms.save_checkpoint(items, str(path))


def load_weights(path: Path, fmt: str) -> Weights:
    if fmt == "ckpt":
        return load_ckpt(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{path}: no *.safetensors files")
        merged: Weights = {}
        for file in files:
            merged.update(load_safetensors(file))
        return merged
    return load_safetensors(path)


def check_weight_dtype(weights: Weights, yaml_path: Path, weight_dtype: str) -> None:
    """The weights are what the predict yaml's ``model.model_config.weight_dtype`` says (ConfigError if not)."""
    from backends.mindspore.modeldir.yaml_tree import ConfigError

    found = weights_format(weights)
    if found != weight_dtype:
        raise ConfigError(yaml_path, "model.model_config.weight_dtype",
                          f"says {weight_dtype}, but the checkpoint's layer matrices are {found}")
