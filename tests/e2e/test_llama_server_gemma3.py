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
    from backends.mindspore.sources.gguf_convert import convert_gguf
    from tests.support.runner import greedy, make_runner

    gguf = write_gguf(make_tiny_gemma3(tmp_path / "src", llama_cpp=True), tmp_path / "gemma3.gguf", "gemma3")
    converted = convert_gguf(gguf, tmp_path / "converted", progress=False)
    prompts = {name: p["input_ids"][-40:] for name, p in PROMPTS.items()}  # within the runner's 64-token window
    with llama_server(gguf, tmp_path / "llama-server.log") as url:
        theirs = {name: llama_greedy(url, ids, NEW_TOKENS) for name, ids in prompts.items()}
    for kernels in ("aot", "stock"):
        runner = make_runner(converted, num_blocks=24, kernels=kernels)
        ours = {name: greedy(runner, ids, NEW_TOKENS, [1, 2, 3, 4])[0] for name, ids in prompts.items()}
        assert ours == theirs, kernels


@pytest.mark.parametrize("variant", ["no_prefix", "prefix"])
def test_the_sentencepiece_import_tokenizes_as_llama_server(tmp_path, variant):
    """A tiny Gemma 3 GGUF carrying the SentencePiece vocabulary of tests/golden/spm_tiny.json (the embedding grown
    to its 400 pieces): the tokenizer convert-gguf rebuilds gives llama-server's ids for every golden text, markers
    (parsed as special) and the space prefix after them included."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from backends.mindspore.sources.gguf_convert import convert_gguf
    from backends.mindspore.modeldir.tokenizer import Tokenizer
    from tests.support.llama_server import llama_tokenize

    spm = json.loads((GOLDEN_DIR / "spm_tiny.json").read_text(encoding="utf-8"))["variants"][variant]
    src = make_tiny_gemma3(tmp_path / "src", llama_cpp=True)
    w = load_file(str(src / "model.safetensors"))
    embed = w["model.embed_tokens.weight"]
    extra = len(spm["meta"]["tokenizer.ggml.tokens"]) - embed.shape[0]
    w["model.embed_tokens.weight"] = np.concatenate([embed, embed[:extra]])
    save_file(w, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "vocab_size": embed.shape[0] + extra}))
    gguf = write_gguf(src, tmp_path / "spm.gguf", "gemma3", spm=spm["meta"])
    ours = Tokenizer.from_model_dir(convert_gguf(gguf, tmp_path / "converted", progress=False))
    texts = [t["text"] for t in spm["texts"] if t["text"]]
    with llama_server(gguf, tmp_path / "llama-server.log") as url:
        theirs = [llama_tokenize(url, t) for t in texts]
    assert [ours.encode(t) for t in texts] == theirs
