"""The model families as the tests see them: every entry of the registry (backends/mindspore/families) beside its
tiny random checkpoint (the writer here in tests/support, the session fixture of tests/conftest.py holding it) and,
where HF transformers made one, its golden file (tests/golden/, by tests/support/scripts/make_<family>_goldens.py).

The per-architecture checks (tests/backends/mindspore/test_family_engine.py, tests/e2e/test_family_http.py, ...)
parametrise over :data:`GOLDEN`; what differs between families is a field of its entry or a capability the registry
declares, never a test of the family's name. Adding a family is one line of ``CHECKPOINTS``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from backends.mindspore.families import FAMILIES, Family
from tests.support.make_tiny_gemma3 import make_tiny_gemma3
from tests.support.make_tiny_qwen2_vl import make_tiny_qwen2_vl
from tests.support.make_tiny_qwen3 import make_tiny_qwen3
from tests.support.make_tiny_qwen3_moe import make_tiny_qwen3_moe
from tests.support.tiny_model import make_tiny_model


@dataclass(frozen=True)
class TinyCheckpoint:
    """A family's tiny checkpoint: how it is written and, for the GGUF agreement tests, its GGUF layout."""

    make: Callable[[Path], Path]  # writes the checkpoint into a directory, returns it
    fixture: str | None = None  # the session fixture tests/conftest.py makes of it
    about: str = ""  # that fixture's docstring
    golden: str | None = None  # tests/golden/ file of HF transformers' ids and logits on it
    # The checkpoint in the layout a GGUF can describe (llama.cpp's loader), when it differs from ``make``'s.
    make_for_gguf: Callable[[Path], Path] | None = None
    llama_server_args: tuple[str, ...] = ()  # llama-server options under which it gives HF's greedy ids
    sliding_window: int | None = None  # the window of its sliding-window layers (a family that declares them)


# With llama-server's defaults (an F16 KV cache, flash attention) the "story" prompt's ids part from HF's and
# mindserve's at the third token on the tiny Qwen3-MoE (measured; the other two prompts agree): its half-precision
# attention moves the tiny router enough to change an expert choice. With float32 K/V and flash attention off it
# gives HF's ids on all three.
F32_ATTENTION = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")

CHECKPOINTS: dict[str, TinyCheckpoint] = {
    "llama": TinyCheckpoint(partial(make_tiny_model, seed=0, arch="llama"), "tiny_model_dir",
                            "Tiny Llama (2 layers, hidden 64, GQA 4:2, tied head, seed 0) with tokenizer and "
                            "predict_tiny.yaml."),
    "qwen2": TinyCheckpoint(partial(make_tiny_model, seed=1, arch="qwen2"), "tiny_qwen2_dir",
                            "Tiny Qwen2 (q/k/v biases, separate lm_head, seed 1)."),
    "qwen3": TinyCheckpoint(make_tiny_qwen3, "tiny_qwen3_dir",
                            "Tiny Qwen3 (q/k head norms, head_dim 32 != hidden / heads, tied head; "
                            "tests/support/make_tiny_qwen3.py), the checkpoint of tests/golden/qwen3_tiny.json.",
                            golden="qwen3_tiny.json"),
    "qwen3_moe": TinyCheckpoint(make_tiny_qwen3_moe, "tiny_qwen3_moe_dir",
                                "Tiny Qwen3-MoE (8 experts top-2, normalised top-k, layer 1 dense; "
                                "tests/support/make_tiny_qwen3_moe.py), the checkpoint of "
                                "tests/golden/qwen3_moe_tiny.json.",
                                golden="qwen3_moe_tiny.json",
                                # every layer with experts, as llama.cpp's qwen3moe has them
                                make_for_gguf=partial(make_tiny_qwen3_moe, mlp_only=[]),
                                llama_server_args=F32_ATTENTION),
    "gemma3": TinyCheckpoint(make_tiny_gemma3, "tiny_gemma3_dir",
                             "Tiny Gemma 3 text (sliding-window layers 0, 1, 3 with a window of 8, a global layer 2, "
                             "tied head; tests/support/make_tiny_gemma3.py), the checkpoint of "
                             "tests/golden/gemma3_tiny.json.",
                             golden="gemma3_tiny.json", sliding_window=8,
                             # 7 layers, every 6th global, query_pre_attn_scalar = head_dim
                             make_for_gguf=partial(make_tiny_gemma3, llama_cpp=True)),
    "qwen2_vl": TinyCheckpoint(make_tiny_qwen2_vl),  # its goldens and tests: tests/backends/mindspore/qwen2_vl/
}


@dataclass(frozen=True)
class TinyFamily:
    """A registry entry with its tiny checkpoint."""

    family: Family
    checkpoint: TinyCheckpoint

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def arch(self) -> str:
        """The HF architecture the checkpoint declares (what /info reports)."""
        return self.family.archs[0]

    @property
    def served_name(self) -> str:
        return "tiny-" + self.name.replace("_", "-")

    def make_for_gguf(self, out_dir: Path) -> Path:
        return (self.checkpoint.make_for_gguf or self.checkpoint.make)(out_dir)

    def __str__(self) -> str:  # the test ids
        return self.name


TINY: tuple[TinyFamily, ...] = tuple(TinyFamily(f, CHECKPOINTS[f.name]) for f in FAMILIES)
GOLDEN: tuple[TinyFamily, ...] = tuple(t for t in TINY if t.checkpoint.golden)
BY_NAME: dict[str, TinyFamily] = {t.name: t for t in TINY}
