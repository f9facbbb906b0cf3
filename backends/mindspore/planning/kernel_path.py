"""Which kernel path a model runs, judged without MindSpore: the names of the paths and the AOT kernels' fit rule
(the runners build the path; preflight's memory check only needs to know which one it will be)."""
from __future__ import annotations

from backends.mindspore.kernels.build import compiler_found, header_constant
from backends.mindspore.modeldir.spec import ModelSpec

MAX_AOT_HEAD_DIM = header_constant("kv_format.h", "kMaxHeadDim")  # the attention kernels' stack buffers
KERNELS = ("auto", "aot", "stock")


def fits_aot(spec: ModelSpec) -> bool:
    """Whether the AOT kernels take this model's attention shape."""
    return spec.head_dim % 2 == 0 and spec.head_dim <= MAX_AOT_HEAD_DIM and spec.num_heads % spec.num_kv_heads == 0


def stock_expected(spec: ModelSpec, kernels: str = "auto") -> bool:
    """Whether the engine will run stock ops, judged without building anything: asked for, another device, an
    attention shape the kernels do not take, or no C++ compiler."""
    return kernels == "stock" or spec.device_target != "CPU" or not fits_aot(spec) or not compiler_found()
