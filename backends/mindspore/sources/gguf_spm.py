"""A GGUF's SentencePiece tokenizer (``tokenizer.ggml.model`` ``llama``: pieces, scores and token types, no merges;
what Gemma and Llama 2 GGUFs carry) rebuilt as a `tokenizers` BPE, as HF's own converter does for SentencePiece BPE
models: merges derived from the vocabulary (every split of a piece into two pieces, ranked by the piece's score,
which is the order SentencePiece's and llama.cpp's merging take), byte fallback to the ``<0xXX>`` pieces, spaces as
``▁`` (with a ``▁`` prefix when ``tokenizer.ggml.add_space_prefix`` says so, as llama.cpp does), control pieces
special."""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token_type values
SPACE = "\u2581"


def spm_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.model 'llama' (SentencePiece) needs tokenizer.ggml.scores, one a token")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, _merges(tokens, scores, types, vocab), fuse_unk=True, byte_fallback=True,
                               unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if prefix else [])
                                          + [normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED])
    post = _bos_eos(meta, tokens)
    if post is not None:
        tok.post_processor = post
    return tok


def _merges(tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a normal piece, the best-scoring pieces' merges first (ties: the
    piece's id, then the left part's id)."""
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _bos_eos(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    """BOS/EOS insertion when tokenizer.ggml.add_{bos,eos}_token say so."""
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
    added = {k: ids[k] for k in ids if ids[k] is not None and meta.get(f"tokenizer.ggml.add_{k}_token")}
    if not added:
        return None
    bos, eos = ([tokens[added[k]]] if k in added else [] for k in ("bos", "eos"))
    single = [*bos, "$A", *eos]
    return processors.TemplateProcessing(single=single, pair=[*single, *bos, "$B:1", *eos],
                                         special_tokens=[(tokens[i], i) for i in set(added.values())])
