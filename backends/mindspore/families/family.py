"""What a model family declares, as frozen data (vLLM's model registry and its ``SupportsLoRA``-style interfaces,
ours as records): the HF architecture names it reads, its config reader, its networks on the two kernel paths, its
GGUF architecture with the tensor map, its capabilities, and (a vision family) its vision part with the interface
the engine asks of it. No MindSpore import: the networks and the vision part are named (``"module:Class"``) and
imported only when an engine builds them."""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from backends.mindspore.modeldir.llama_config import LayerDefaults

if TYPE_CHECKING:
    import numpy as np

    from backends.mindspore.modeldir.spec import ModelSpec
    from backends.mindspore.modeldir.yaml_tree import YamlSection
    from backends.types import MediaInput

# (yaml path, the whole yaml tree, its ``model`` section, model.arch.type) -> the spec
Reader = Callable[[Path, dict, "YamlSection", str], "ModelSpec"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the family's networks can do, declared (never discovered from a spec's fields)."""

    lora: bool = True  # adapter slots (LoRA) in its layers
    vision: bool = False  # image and video parts (a vision tower)
    moe: bool = False  # routed experts in (some of) its layers
    sliding_window: bool = False  # sliding-window (local) attention layers
    stock_low_precision: bool = True  # the stock-op path computes in the yaml's compute_dtype off CPU (else float32)


@dataclass(frozen=True, slots=True)
class GgufArch:
    """A GGUF ``general.architecture`` that ``convert-gguf`` imports, and its tensor map onto the HF layout."""

    name: str  # general.architecture, the prefix of its metadata keys (``qwen3.embedding_length``)
    hf_arch: str  # config.json architectures[0], the predict yaml's model.arch.type
    model_type: str
    permuted_qk: bool  # llama.cpp permuted the Q/K rows for interleaved RoPE (undone at conversion)
    renames: tuple[tuple[str, str], ...] = ()  # GGUF layer tensor kinds whose HF names differ from the Llama ones
    norm_shift: float = 0.0  # llama.cpp stored every ``*norm.weight`` plus this (Gemma 3: 1 + w); undone at import
    # The family's own config.json keys from the GGUF metadata: (meta, layers, hidden, heads, head_dim) -> keys
    config: Callable[[dict[str, Any], int, int, int, int], dict[str, Any]] | None = None


class UnsupportedGguf(ValueError):
    """A GGUF ``convert-gguf`` cannot import (its message names what and the supported choices)."""


@dataclass(frozen=True, slots=True)
class HfWrapper:
    """A multimodal HF config that wraps this family's text model (its ``text_config``), and what to say of it."""

    model_type: str  # config.json model_type whose text_config holds this family's keys
    refused_arch: str  # the multimodal architecture itself, not served
    why: str


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: everything the tree needs to know about it, in one record."""

    name: str
    described: str  # how a refusal names it ("Gemma 3", "a model with routed experts")
    archs: tuple[str, ...]  # HF architecture names (model.arch.type / config.json architectures[0])
    read: Reader = field(repr=False)
    aot: str  # the network on the AOT kernels, "module:Class"
    stock: str  # the network on stock MindSpore ops, "module:Class"
    capabilities: Capabilities = Capabilities()
    defaults: LayerDefaults = LayerDefaults()
    gguf: GgufArch | None = None
    config_keys: tuple[str, ...] = ()  # config.json keys its reader reads beyond the Llama ones (copied into yamls)
    hf_wrapper: HfWrapper | None = None
    vision: str = ""  # its vision part (``VisionPart``), "module:Class"; a family whose capabilities take media

    def network(self, kernels: str) -> type:
        """The network class for ``kernels`` ("aot" | "stock"), imported now (it imports MindSpore)."""
        return _named(self.aot if kernels == "aot" else self.stock)

    def vision_part(self) -> type[VisionPart] | None:
        """The class of its vision part, imported now (it imports MindSpore); None for a text family."""
        return _named(self.vision) if self.vision else None


def _named(where: str) -> type:
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


class MediaSpan(Protocol):
    """Where one media item's tokens sit in a prompt, and its digest (mixed into the prefix cache's blocks)."""

    start: int
    end: int  # exclusive
    digest: bytes


class MediaPrompt(Protocol):
    """A prompt with media as the engine reads it: its ids, positions ``[axes, L]``, the offset of a position
    after it from its cache index (``delta``) and each item's span."""

    ids: tuple[int, ...]
    positions: np.ndarray
    delta: int
    spans: tuple[MediaSpan, ...]


class VisionPart(Protocol):
    """What the engine asks of a vision family's part (its vision tower over its own compiled graphs), built once
    from ``spec.vision`` and the checkpoint's arrays: a request's prompt with its media on the submitting thread,
    the items each step's prompt chunks reach encoded on the engine thread before the forward pass, its graphs
    compiled at warm-up."""

    compiled: set

    @staticmethod
    def read_weights(spec: ModelSpec) -> dict[str, np.ndarray]:
        """The checkpoint's arrays, the language model's and the tower's, checked by name."""

    @staticmethod
    def chat_template(model_dir: Path) -> str:
        """The processor's chat template, for a tokenizer without one."""

    def prompt(self, text: str, media: Sequence[MediaInput], encode: Callable[[str], list[int]],
               kept: Callable[[int], tuple[int, int]], max_seq_len: int, max_window: int
               ) -> tuple[MediaPrompt | None, list]:
        """The prompt and its media items, cut to the tokens ``kept(n)`` keeps of n (never through an item);
        (None, []) without media; InputRejected for media it cannot take or positions past ``max_window``."""

    def encode_reached(self, prefill: Sequence[tuple[Any, int]], fail: Callable[[Any, BaseException], None]
                       ) -> list:
        """Encode the items the planned prompt chunks reach; the sequences that failed (handed to ``fail``)."""

    def warmup(self) -> None:
        """Compile every graph it will call."""


def table(families: tuple[Family, ...]) -> Mapping[str, Family]:
    """Architecture name -> family; an architecture claimed twice is a bug in the table."""
    out: dict[str, Family] = {}
    for family in families:
        for arch in family.archs:
            assert arch not in out, f"{arch} is claimed by {out[arch].name} and {family.name}"
            out[arch] = family
    return out
