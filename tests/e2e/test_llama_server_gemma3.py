"""The tiny Gemma 3 checkpoint (make_tiny_gemma3's ``llama_cpp`` variant: 7 layers, layer 5 global, a window of 8)
written as a float32 GGUF (tests/support/hf_to_gguf.py): llama.cpp's own ``llama-server`` on the file and mindserve
on its conversion (both kernel paths) give the same greedy ids for the golden prompts, sent to both as token ids.
Skipped when no llama-server is built (../shared/tools/build-llama-anchors.sh into ~/.cache/llama-anchors)."""
from __future__ import annotations

import json

import pytest

from tests.support.hf_to_gguf import write_gguf
from tests.support.llama_server import llama_greedy, llama_server, llama_server_binary
from tests.support.make_tiny_gemma3 import make_tiny_gemma3
from tests.support.paths import GOLDEN_DIR

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(llama_server_binary() is None, reason="no llama-server in ~/.cache/llama-anchors")]
NEW_TOKENS = 16
PROMPTS = json.loads((GOLDEN_DIR / "gemma3_tiny.json").read_text(encoding="utf-8"))["prompts"]


def test_gemma3_greedy_ids_agree_with_llama_server(tmp_path):
    from backends.mindspore.gguf_convert import convert_gguf
    from tests.support.runner import greedy, make_runner

    gguf = write_gguf(make_tiny_gemma3(tmp_path / "src", llama_cpp=True), tmp_path / "gemma3.gguf", "gemma3")
    converted = convert_gguf(gguf, tmp_path / "converted", progress=False)
    prompts = {name: p["input_ids"][-40:] for name, p in PROMPTS.items()}  # within the runner's 64-token window
    with llama_server(gguf, tmp_path / "llama-server.log") as url:
        theirs = {name: llama_greedy(url, ids, NEW_TOKENS) for name, ids in prompts.items()}
    for kernels in ("aot", "ms"):
        runner = make_runner(converted, num_blocks=24, kernels=kernels)
        ours = {name: greedy(runner, ids, NEW_TOKENS, [1, 2, 3, 4])[0] for name, ids in prompts.items()}
        assert ours == theirs, kernels
