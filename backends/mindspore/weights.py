"""Weights in, weights out: HF safetensors and MindSpore .ckpt (MindFormers names), as HF-named numpy arrays."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

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


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not path.exists():
        raise WeightsError(f"{path}: no such weights file")
    try:
        tensors = load_file(str(path))
    except TypeError:  # bfloat16 (how most HF checkpoints ship): NumPy has no such dtype, MindSpore's reader does
        import mindspore as ms

        tensors = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path), format="safetensors").items()}
    except SafetensorError as exc:
        raise WeightsError(f"{path}: not a safetensors file: {exc}") from None
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


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


def load_weights(path: Path, fmt: str) -> dict[str, np.ndarray]:
    if fmt == "ckpt":
        return load_ckpt(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{path}: no *.safetensors files")
        merged: dict[str, np.ndarray] = {}
        for file in files:
            merged.update(load_safetensors(file))
        return merged
    return load_safetensors(path)
