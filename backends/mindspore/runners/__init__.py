"""The runners: the interface (base.py) and its two strategies (packed.py, split.py), chosen once at start-up
by ``build_runner``; the step's plain rows they read (step.py) and the page mapping of the KV cache memory they
hold (kv_pages.py)."""
from __future__ import annotations

import logging

import numpy as np

from backends.mindspore.families import family_of
from backends.mindspore.planning.kernel_path import KERNELS, fits_aot, stock_expected
from backends.mindspore.planning.kv_dtype import cache_dtype
from backends.mindspore.runners.base import ModelRunner, write_rows
from backends.mindspore.runners.packed import PackedRunner
from backends.mindspore.runners.split import SplitRunner
from backends.mindspore.planning.shapes import Shapes
from backends.mindspore.modeldir.spec import ModelSpec
from backends.mindspore.runners.step import DecodeRow, PrefillChunk, RowOutput

__all__ = ["KERNELS", "choose_kernels", "stock_expected",
           "DecodeRow", "ModelRunner", "PackedRunner", "PrefillChunk", "RowOutput", "SplitRunner",
           "build_runner", "write_rows"]

log = logging.getLogger("mindserve.engine")


def _aot_ops(spec: ModelSpec, kernel_isa: str = "auto"):
    """The AOT kernels (an ``AotOps``) of the build variant ``kernel_isa`` asks for (``auto``: the best this CPU
    runs, or $MINDSERVE_KERNEL_ISA), or None with a warning where they cannot be built or do not fit the model.
    A named variant this CPU cannot run is a ValueError naming the key."""
    from backends.mindspore.kernels import KernelBuildError, aot_ops, choose_variant

    if not fits_aot(spec):
        log.warning("AOT kernels do not support head_dim %d with %d heads / %d kv heads; using stock MindSpore "
                    "ops", spec.head_dim, spec.num_heads, spec.num_kv_heads)
        return None
    requested = None if kernel_isa == "auto" else kernel_isa
    try:
        variant = choose_variant(requested).name
    except KernelBuildError as exc:
        key = "BackendConfig.ModelDeployConfig.kernelIsa" if requested else "the environment's MINDSERVE_KERNEL_ISA"
        raise ValueError(f"{key}: {exc}") from None
    try:
        return aot_ops(spec.num_heads, spec.num_kv_heads, spec.head_dim, variant=variant)
    except KernelBuildError as exc:
        log.warning("AOT kernels unavailable, using stock MindSpore ops: %s", exc)
        return None


def choose_kernels(spec: ModelSpec, kernels: str = "stock", device: str = "CPU", kernel_isa: str = "auto"):
    """The AOT operators the runner will use (an ``AotOps``), or None for the stock-op path: decided once, before
    the memory budget (the stock path holds float32 weights and every graph's activations)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if device != "CPU":
        if kernels == "aot":
            raise ValueError(f"kernels 'aot' asked for, but the AOT kernels are CPU kernels and the model's "
                             f"context.device_target is {device}")
        return None
    aot = _aot_ops(spec, kernel_isa) if kernels != "stock" else None
    if kernels == "aot" and aot is None:
        raise RuntimeError("kernels 'aot' asked for, but the AOT kernels could not be built (see the log)")
    return aot


def build_runner(spec: ModelSpec, weights: dict[str, np.ndarray], shapes: Shapes, num_blocks: int,
                 kernels: str = "stock", device: str = "CPU", lora: tuple[int, int] | None = None,
                 kernel_isa: str = "auto", aot=False, kv_dtype: str = "float32",
                 window_blocks: int = 0) -> ModelRunner:
    """The runner for ``kernels`` (auto|aot|stock) on ``device``: on CPU the AOT kernels where asked and they
    build (float32, the KV cache in ``kv_dtype``: ``kv_dtype.cache_dtype``); elsewhere the stock ops in the yaml's
    compute_dtype where the family's stock path computes in it (else float32). ``aot``: the operators
    ``choose_kernels`` already chose (None: stock ops); ``window_blocks``: the sliding-window layers' pool (the
    AOT path only: engine/window_pool.py)."""
    if aot is False:
        aot = choose_kernels(spec, kernels, device, kernel_isa)
    kv_dtype = cache_dtype(kv_dtype, stock=aot is None)
    if aot is None:
        low = device != "CPU" and family_of(spec.arch).capabilities.stock_low_precision
        runner: ModelRunner = SplitRunner(spec, weights, shapes, num_blocks, dtype=spec.compute_dtype if low
                                          else "float32", lora=lora)
    else:
        runner = PackedRunner(spec, weights, shapes, num_blocks, aot, lora=lora, kv_dtype=kv_dtype,
                              window_blocks=window_blocks)
    variant = f" [variant {runner.kernel_variant['variant']}, {runner.kernel_variant['isa']} vectors]" \
        if runner.kernel_variant else ""
    log.info("kernels: %s%s on %s, %s, KV cache %s", runner.description, variant, device, runner.dtype,
             runner.kv_dtype)
    return runner
