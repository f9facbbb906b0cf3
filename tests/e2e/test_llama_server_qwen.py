"""The tiny Qwen3, Qwen3-MoE (every layer with experts, as llama.cpp's qwen3moe has them) and Qwen2 checkpoints
written as float32 GGUFs (tests/support/hf_to_gguf.py): llama.cpp's own
``llama-server`` on each file and mindserve on its conversion (the AOT kernels) give the same greedy ids for the
golden prompts, sent to both as token ids. Skipped when no llama-server is built
(../shared/tools/build-llama-anchors.sh into ~/.cache/llama-anchors)."""
from __future__ import annotations

import json

import pytest

from tests.support.families import BY_NAME
from tests.support.hf_to_gguf import write_gguf
from tests.support.llama_server import llama_greedy, llama_server, llama_server_binary
from tests.support.paths import GOLDEN_DIR

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(llama_server_binary() is None, reason="no llama-server in ~/.cache/llama-anchors")]
NEW_TOKENS = 20
PROMPTS = json.loads((GOLDEN_DIR / "qwen3_tiny.json").read_text(encoding="utf-8"))["prompts"]


@pytest.mark.parametrize("tiny", [BY_NAME[n] for n in ("qwen3", "qwen3_moe", "qwen2")], ids=str)
def test_greedy_ids_agree_with_llama_server(tiny, tmp_path):
    """The checkpoint in the layout its GGUF can describe, with the llama-server options under which it gives HF's ids
    (tests/support/families.py: the tiny Qwen3-MoE's router needs float32 attention there)."""
    from backends.mindspore.sources.gguf_convert import convert_gguf
    from tests.support.runner import greedy, make_runner

    arch = tiny.family.gguf.name
    src = tiny.make_for_gguf(tmp_path / "src")
    gguf = write_gguf(src, tmp_path / f"{arch}.gguf", arch)
    runner = make_runner(convert_gguf(gguf, tmp_path / "converted", progress=False), num_blocks=24, kernels="aot")
    prompts = {name: p["input_ids"][-40:] for name, p in PROMPTS.items()}  # within the runner's 64-token window
    ours = {name: greedy(runner, ids, NEW_TOKENS, [1, 2, 3, 4])[0] for name, ids in prompts.items()}
    with llama_server(gguf, tmp_path / "llama-server.log", extra=tiny.checkpoint.llama_server_args) as url:
        theirs = {name: llama_greedy(url, ids, NEW_TOKENS) for name, ids in prompts.items()}
    assert ours == theirs
