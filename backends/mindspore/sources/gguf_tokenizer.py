"""A GGUF's tokenizer metadata -> the HF tokenizer files: ``tokenizer.json`` rebuilt as a `tokenizers` tokenizer
(byte-level BPE, ``gpt2``; SentencePiece, ``llama``: ``gguf_spm.py``) and ``tokenizer_config.json``
(``gguf_convert.py`` writes both)."""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Pre-tokenizer split patterns for llama.cpp's `tokenizer.ggml.pre` values.
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token_type values


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild a `tokenizers` tokenizer from GGUF tokenizer metadata: byte-level BPE (``gpt2``) or SentencePiece
    (``llama``)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece (Gemma, Llama 2): gguf_spm.py
        from backends.mindspore.sources.gguf_spm import spm_tokenizer

        return spm_tokenizer(meta)
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer.ggml.model {kind!r}: only 'gpt2' (byte-level BPE) and 'llama' "
                         "(SentencePiece with scores) can be rebuilt")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                               byte_fallback=False, ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([_added(tokens[i], True) for i, t in enumerate(types)
                            if t == _TOKEN_CONTROL])
    tok.add_tokens([_added(tokens[i], False) for i, t in enumerate(types)
                    if t == _TOKEN_USER_DEFINED])
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt-2"):
        return byte_level
    if pre in ("llama-bpe", "qwen2"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_RE if pre == "llama-bpe" else _QWEN2_RE),
                                     behavior="isolated", invert=False)
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"unsupported GGUF tokenizer.ggml.pre {pre!r}")


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """ByteLevel offsets, plus BOS/EOS insertion when tokenizer.ggml.add_{bos,eos}_token say so."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    ids = special_ids(meta)
    added = {k: ids[k] for k in ("bos", "eos")
             if ids[k] is not None and meta.get(f"tokenizer.ggml.add_{k}_token")}
    if not added:
        return byte_level
    bos, eos = ([tokens[added[k]]] if k in added else [] for k in ("bos", "eos"))
    single = [*bos, "$A", *eos]
    template = processors.TemplateProcessing(
        single=single, pair=[*single, *bos, "$B:1", *eos],
        special_tokens=[(tokens[i], i) for i in set(added.values())])
    return processors.Sequence([byte_level, template])


def special_ids(meta: dict[str, Any]) -> dict[str, int | None]:
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id",
            "unk": "unknown_token_id", "eot": "eot_token_id"}
    return {k: meta.get(f"tokenizer.ggml.{v}") for k, v in keys.items()}


def tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens, ids = meta["tokenizer.ggml.tokens"], special_ids(meta)
    types = meta.get("tokenizer.ggml.token_type", [])
    added = {str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t == _TOKEN_CONTROL}
             for i, t in enumerate(types) if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)}
    text = {k: tokens[ids[k]] if ids[k] is not None else None for k in ("bos", "eos", "pad", "unk")}
    return {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "added_tokens_decoder": added,
        **{f"{k}_token": v for k, v in text.items()},
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
