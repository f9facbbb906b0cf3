"""The import path ``bench/`` still uses (it is edited elsewhere); everything lives in ``runners/``."""
from backends.mindspore.runners import DecodeRow, ModelRunner, PrefillChunk, RowOutput, build_runner

__all__ = ["DecodeRow", "ModelRunner", "PrefillChunk", "RowOutput", "build_runner"]
