"""MindSpore's process-wide context: GRAPH or PyNative mode, the device the yaml's ``context`` names (a
missing runtime is a ConfigError naming the key), the CPU thread count."""
from __future__ import annotations

import contextlib
import logging

import mindspore as ms

from backends.heap import give_back
from backends.mindspore.modeldir.spec import ModelSpec
from backends.mindspore.modeldir.yaml_tree import DEVICE_TARGETS, ConfigError


_threads_set: list[int] = []  # MindSpore's CPU threads as first set in this process (0: left at its default)
log = logging.getLogger("mindserve.engine")


def set_mode(mode: int, device_target: str, threads: int | None) -> int:
    """Global MindSpore context: GRAPH_MODE (0) or PYNATIVE_MODE (1); CPU threads (settable once per process:
    a later engine asking another count is told so). Returns MindSpore's thread count in effect (0: unknown)."""
    ms.set_context(mode=ms.GRAPH_MODE if mode == 0 else ms.PYNATIVE_MODE)
    if not _threads_set:
        try:
            ms.set_device(device_target)
            if threads:
                ms.device_context.cpu.op_tuning.threads_num(threads)
        except RuntimeError as exc:  # the runtime already started (some op ran first): keep its settings
            log.warning("MindSpore device/threads left as they are: %s", exc)
            threads = 0
        _threads_set.append(threads or 0)
    elif threads and _threads_set[0] and threads != _threads_set[0]:
        log.warning("MindSpore's CPU threads stay at %d in this process (set once); the AOT kernels take %d",
                    _threads_set[0], threads)
    if mode == 1:
        ms.runtime.launch_blocking()  # PyNative's async dispatch costs ~1 ms per op on CPU
    return _threads_set[0]


def mindspore_threads() -> int:
    """MindSpore's CPU thread count as set in this process (0: not set, its own default)."""
    return _threads_set[0] if _threads_set else 0


def set_device(spec: ModelSpec, threads: int | None) -> str:
    """Set MindSpore's context to the yaml's ``context`` (mode, device_target) and return the device it runs
    on. A target whose runtime is absent is a ConfigError naming the yaml key and what was found."""
    target = spec.device_target
    if not _available(target):
        found = [t for t in DEVICE_TARGETS if t != target and _available(t)]
        raise ConfigError(spec.yaml_path, "context.device_target",
                          f"{target}, but this MindSpore {ms.__version__} has no {target} runtime "
                          f"(found: {', '.join(found) or 'none'})")
    set_mode(spec.mode, target, threads)
    actual = ms.get_context("device_target")
    if actual != target:
        raise ConfigError(spec.yaml_path, "context.device_target",
                          f"{target}, but MindSpore already runs on {actual} in this process")
    return actual


def free_network(net) -> None:
    """Give back the memory of a network no step will run again (its engine closed). MindSpore's graph executor
    keeps each compiled graph's cell, and through it every Parameter (weights, KV cache), alive after the network
    is dropped (MindSpore 2.9; measured: the whole network's memory per engine loaded and closed), so the graphs
    are released and each Parameter's storage replaced by a single element."""
    import numpy as np
    from mindspore.graph.api import _cell_graph_executor as executor  # no public API releases them

    executor.del_net_res(net, net.compile_cache)
    executor._graph_executor.set_weights_values({})
    for param in net.get_parameters():
        one = ms.Tensor(np.zeros((1,) * len(param.shape), np.float32)).astype(param.dtype)
        param.set_data(one, slice_shape=True)
    give_back()  # what the network freed, out of malloc's arenas too (heap.py)


def _available(target: str) -> bool:
    from mindspore import hal

    with _quiet_mindspore():  # a missing runtime is our error to report, not a page of plugin warnings
        return bool(hal.is_available(target))


@contextlib.contextmanager
def _quiet_mindspore():
    try:
        from mindspore import log as ms_log

        logger = ms_log._get_logger()  # MindSpore's own logger (not under the "mindspore" name)
    except (ImportError, AttributeError):
        yield
        return
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
