"""The import path ``bench/`` and the kernel tests still use (both edited elsewhere): the networks live in
``network/``, MindSpore's context in ``device.py``."""
from backends.mindspore.device import set_device, set_mode
from backends.mindspore.network.common import rope_tables

__all__ = ["rope_tables", "set_device", "set_mode"]
