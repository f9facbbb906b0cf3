"""The runners: the interface (base.py) and its two strategies (packed.py, split.py), chosen once at start-up
by ``build_runner``."""
from __future__ import annotations

import logging

import numpy as np

from backends.mindspore.runners.base import DecodeRow, ModelRunner, PrefillChunk, RowOutput, write_rows
from backends.mindspore.runners.packed import PackedRunner
from backends.mindspore.runners.split import SplitRunner
from backends.mindspore.shapes import Shapes
from backends.mindspore.spec import ModelSpec

__all__ = ["KERNELS", "DecodeRow", "ModelRunner", "PackedRunner", "PrefillChunk", "RowOutput", "SplitRunner",
           "build_runner", "write_rows"]

log = logging.getLogger("mindserve.engine")

MAX_AOT_HEAD_DIM = 512  # attention.cc kMaxHeadDim
KERNELS = ("auto", "aot", "stock")
KERNEL_ALIASES = {"ms": "stock"}  # the old name of the stock-op path, still accepted (bench/ and tests pass it)


def _aot_ops(spec: ModelSpec):
    """The AOT kernels (an ``AotOps``), or None with a warning where they cannot be built or do not fit
    the model."""
    from backends.mindspore.kernels import KernelBuildError, aot_ops

    if spec.head_dim % 2 or spec.head_dim > MAX_AOT_HEAD_DIM or spec.num_heads % spec.num_kv_heads:
        log.warning("AOT kernels do not support head_dim %d with %d heads / %d kv heads; using stock MindSpore "
                    "ops", spec.head_dim, spec.num_heads, spec.num_kv_heads)
        return None

    try:
        return aot_ops(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    except KernelBuildError as exc:
        log.warning("AOT kernels unavailable, using stock MindSpore ops: %s", exc)
        return None


def build_runner(spec: ModelSpec, weights: dict[str, np.ndarray], shapes: Shapes, num_blocks: int,
                 kernels: str = "stock", device: str = "CPU", lora: tuple[int, int] | None = None,
                 vl=None) -> ModelRunner:
    """The runner for ``kernels`` (auto|aot|stock) on ``device``: on CPU the AOT kernels where asked and they
    build (float32); elsewhere the stock ops in the yaml's compute_dtype (float32 for a vision-language
    model, ``vl`` its VLSpec)."""
    kernels = KERNEL_ALIASES.get(kernels, kernels)
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if device != "CPU":
        if kernels == "aot":
            raise ValueError(f"kernels 'aot' asked for, but the AOT kernels are CPU kernels and the model's "
                             f"context.device_target is {device}")
        dtype = "float32" if vl is not None else spec.compute_dtype
        runner: ModelRunner = SplitRunner(spec, weights, shapes, num_blocks, dtype=dtype, lora=lora, vl=vl)
    else:
        aot = _aot_ops(spec) if kernels != "stock" else None
        if kernels == "aot" and aot is None:
            raise RuntimeError("kernels 'aot' asked for, but the AOT kernels could not be built (see the log)")
        runner = (PackedRunner(spec, weights, shapes, num_blocks, aot, lora=lora, vl=vl) if aot is not None
                  else SplitRunner(spec, weights, shapes, num_blocks, lora=lora, vl=vl))
    log.info("kernels: %s on %s, %s", runner.description, device, runner.dtype)
    return runner
