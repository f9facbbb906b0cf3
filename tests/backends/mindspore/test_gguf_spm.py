"""The GGUF SentencePiece tokenizer import (backends/mindspore/sources/gguf_spm.py) against the `sentencepiece`
library's
own ids and decoded text (tests/golden/spm_tiny.json, tests/support/scripts/make_spm_goldens.py): a tiny BPE model
with byte fallback, without and with the dummy space prefix; and convert-gguf's refusal of a tokenizer model it does
not rebuild."""
from __future__ import annotations

import json
from functools import cache

import pytest

from backends.mindspore.sources.gguf_tokenizer import build_tokenizer
from tests.support.paths import GOLDEN_DIR


@cache
def golden() -> dict:
    return json.loads((GOLDEN_DIR / "spm_tiny.json").read_text(encoding="utf-8"))


def _compared(variant: str) -> list[dict]:
    """The golden texts; with the space prefix, not those holding a marker: there sentencepiece prefixes the whole
    text once, while llama.cpp (and HF's legacy Llama tokenizer) prefix each text fragment after a special token
    (test_the_space_prefix_follows_llama_cpp_after_a_marker)."""
    texts = golden()["variants"][variant]["texts"]
    return [t for t in texts if variant == "no_prefix" or "<start_of_turn>" not in t["text"]]


@pytest.mark.parametrize("variant", ["no_prefix", "prefix"])
def test_ids_and_text_are_sentencepieces(variant):
    v = golden()["variants"][variant]
    tok = build_tokenizer(v["meta"])
    bad = [t["text"] for t in _compared(variant) if tok.encode(t["text"], add_special_tokens=False).ids != t["ids"]]
    assert not bad, f"{len(bad)} of {len(v['texts'])} texts encode differently, first {bad[0]!r}"
    for t in v["texts"]:
        assert tok.decode(t["ids"]) == t["decoded"], t["text"]


def test_byte_fallback_and_markers_are_exercised():
    """The goldens cover what makes SentencePiece differ from plain BPE: <0xXX> pieces and user-defined markers."""
    meta = golden()["variants"]["no_prefix"]["meta"]
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    ids = {i for t in golden()["variants"]["no_prefix"]["texts"] for i in t["ids"]}
    assert any(types[i] == 6 for i in ids) and any(tokens[i] == "<start_of_turn>" for i in ids)


def test_a_tokenizer_model_it_cannot_rebuild_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 'bert'.*'gpt2'.*'llama'"):
        build_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_sentencepiece_without_scores_is_refused():
    with pytest.raises(ValueError, match="needs tokenizer.ggml.scores"):
        build_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"]})


def test_the_space_prefix_follows_llama_cpp_after_a_marker():
    """llama.cpp's SPM tokenizer puts " " before every raw-text fragment that starts the text or follows a special
    token (llama-vocab.cpp, ``is_prev_special``); the fragments are tokenized apart."""
    meta = golden()["variants"]["prefix"]["meta"]
    tok = build_tokenizer(meta)
    pieces = meta["tokenizer.ggml.tokens"]
    got = [pieces[i] for i in tok.encode("<start_of_turn>user<end_of_turn>", add_special_tokens=False).ids]
    assert got == ["<start_of_turn>", *[pieces[i] for i in tok.encode("user", add_special_tokens=False).ids],
                   "<end_of_turn>"]
    assert got[1].startswith("\u2581")
