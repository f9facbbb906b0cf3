"""A bounded safetensors reader: the 8-byte length, the JSON header and every tensor's dtype, shape and byte
range are checked before any tensor data is read, so a truncated or hostile file fails without allocating
what its header claims. Tensors come back as float32 (F32, F16 and BF16 on disk)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from backends import bounded_json

HEADER_CAP = 1 << 20  # bytes; a LoRA header for 30 layers x 7 projections is ~55 KB
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = ("F32", "F16", "BF16")


class SafetensorsFormatError(ValueError):
    """The file is not a well-formed safetensors file; ``key`` is the tensor concerned, if one is."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]
    file_size: int


def read_header(path: Path, accepted: Collection[str] = FLOAT_DTYPES, cap: int = HEADER_CAP) -> Header:
    """Parse and check the header of ``path``; reads at most 8 + ``cap`` bytes."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        length = _header_length(f.read(8), size, cap)
        raw = f.read(length)
    if len(raw) != length:
        raise SafetensorsFormatError(f"the header ends early at byte {8 + len(raw)} of {8 + length} (file changed?)")
    header = _parse_json(raw)
    metadata = _metadata(header.pop("__metadata__", {}))
    data_start = 8 + length
    entries = [_entry(name, value, accepted, data_start) for name, value in header.items()]
    _check_layout(entries, data_start, size)
    return Header({e.name: e for e in entries}, metadata, size)


def read_tensor(f: BinaryIO, entry: TensorEntry) -> np.ndarray:
    """The tensor's data as a C-contiguous float32 array (``f`` opened in binary mode on the same file)."""
    f.seek(entry.begin)
    nbytes = entry.end - entry.begin
    buf = f.read(nbytes)
    if len(buf) != nbytes:
        raise SafetensorsFormatError(f"tensor {entry.name!r}: file ended after {len(buf)} of its {nbytes} bytes "
                                     "(file changed since its header was read?)", entry.name)
    if entry.dtype == "BF16":  # bfloat16 is the top half of a float32
        out = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        out = np.frombuffer(buf, "<f4" if entry.dtype == "F32" else "<f2").astype(np.float32)
    return out.reshape(entry.shape)


def _header_length(prefix: bytes, size: int, cap: int) -> int:
    if len(prefix) < 8:
        raise SafetensorsFormatError(f"the file is {size} bytes, too short for the 8-byte header length (truncated?)")
    length = int.from_bytes(prefix, "little")
    if length > cap:
        raise SafetensorsFormatError(f"header length {length} exceeds the {cap}-byte limit")
    if length > size - 8:
        raise SafetensorsFormatError(f"header length {length} runs past the end of the {size}-byte file (truncated?)")
    return length


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:  # a header nests 3 deep: {name: {"shape": [...]}}
        header = bounded_json.loads(raw, max_depth=3, unique_keys=True)
    except ValueError as exc:
        raise SafetensorsFormatError(f"the header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"the header is a JSON {type(header).__name__}, not an object")
    return header


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SafetensorsFormatError("__metadata__ must map strings to strings", "__metadata__")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(name: str, value: Any, accepted: Collection[str], data_start: int) -> TensorEntry:
    def fail(what: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(f"tensor {name!r}: {what}", name)

    if not isinstance(value, dict):
        raise fail("its header entry is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in accepted:
        raise fail(f"dtype {dtype!r} is not accepted (accepted: {', '.join(accepted)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise fail(f"shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise fail(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise fail(f"shape {shape} in {dtype} is {nbytes} bytes but data_offsets {offsets} "
                   f"span {offsets[1] - offsets[0]}")
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_layout(entries: list[TensorEntry], data_start: int, size: int) -> None:
    """Every byte range lies inside the file; the ranges tile the data area with no overlap and no gap."""
    for e in entries:
        if e.end > size:
            raise SafetensorsFormatError(f"tensor {e.name!r}: its data runs to byte {e.end} but the file is "
                                         f"{size} bytes (truncated?)", e.name)
    position, previous = data_start, None
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin < position:
            raise SafetensorsFormatError(f"tensor {e.name!r}: its data overlaps tensor {previous!r}'s", e.name)
        if e.begin > position:
            raise SafetensorsFormatError(f"tensor {e.name!r}: bytes {position - data_start}.."
                                         f"{e.begin - data_start} before it belong to no tensor", e.name)
        position, previous = e.end, e.name
    if position != size:
        raise SafetensorsFormatError(f"{size - position} bytes after the last tensor belong to no tensor")
