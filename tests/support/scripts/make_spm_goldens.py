"""Goldens for the GGUF SentencePiece tokenizer import (backends/mindspore/sources/gguf_spm.py), from the reference
implementation: the `sentencepiece` library trains a tiny BPE model with byte fallback on tests/support/tiny_model.py's
corpus (Gemma's settings: identity normalisation keeping every space, digits split, two user-defined turn markers;
once without and once with the dummy space prefix) and encodes and decodes a few texts. Run once in a separate
environment (sentencepiece is not a dependency of the project):

    /tmp/hfenv/bin/pip install sentencepiece
    /tmp/hfenv/bin/python -m tests.support.scripts.make_spm_goldens --write

Writes tests/golden/spm_tiny.json: per variant the GGUF tokenizer metadata llama.cpp's converter would write
(``tokenizer.ggml.tokens`` / ``scores`` / ``token_type`` / ids / ``add_space_prefix``) and, per text, sentencepiece's
ids and decoded text.
"""
from __future__ import annotations

import argparse
import io
import json

from tests.support.paths import GOLDEN_DIR
from tests.support.tiny_checkpoint import CORPUS

GOLDEN = GOLDEN_DIR / "spm_tiny.json"
MARKERS = ["<start_of_turn>", "<end_of_turn>"]
TEXTS = ["The small model reads a line of text and guesses the next word.", "Hello  world!\n\ttabs and  spaces",
         "naïve café 😀 中文 ", "  leading and trailing  ", "12345 and 2024", "<start_of_turn>user\nHi<end_of_turn>\n",
         "unseen: Zyzzyva qoph 0x7F", ""]


def variant(prefix: bool) -> dict:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=buf, vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=prefix, split_digits=True,
        remove_extra_whitespaces=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=MARKERS,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())

    def kind(i: int) -> int:  # llama.cpp's token types, as convert_hf_to_gguf.py's _create_vocab_sentencepiece
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        if sp.is_unused(i):
            return 5
        return 4 if sp.id_to_piece(i) in MARKERS else 1

    n = sp.get_piece_size()
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
            "tokenizer.ggml.token_type": [kind(i) for i in range(n)], "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.add_space_prefix": prefix}
    texts = [{"text": t, "ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))} for t in TEXTS + CORPUS.splitlines()]
    return {"meta": meta, "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    import sentencepiece

    golden = {"made_by": f"sentencepiece {sentencepiece.__version__}",
              "variants": {"no_prefix": variant(False), "prefix": variant(True)}}
    for name, v in golden["variants"].items():
        print(name, len(v["meta"]["tokenizer.ggml.tokens"]), "pieces,", v["texts"][0]["ids"])
    if args.write:
        GOLDEN.write_text(json.dumps(golden, indent=0, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
