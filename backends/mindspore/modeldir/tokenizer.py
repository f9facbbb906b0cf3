"""The model's tokenizer: encode/decode, special and EOS ids, chat template, and UTF-8-safe
incremental detokenisation. Backed by `tokenizers` (tokenizer.json); a sentencepiece-only
yaml needs MindFormers.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import tokenizers

from backends.heap import give_back

log = logging.getLogger("mindserve.model")

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 byte sequence


class TokenizerLoadError(RuntimeError):
    """The model directory's tokenizer cannot be loaded; the message names the file."""


class Tokenizer:
    """Encode/decode plus the special-token facts the engine needs.

    `config` is tokenizer_config.json-shaped. When it states `add_bos_token`/`add_eos_token`,
    encode() applies them itself (BOS is not doubled if the text already starts with it);
    when it does not, the backend's own post-processor decides.
    """

    def __init__(self, backend: Any, config: Mapping[str, Any] | None = None,
                 extra_eos_ids: Iterable[int] = (), extra_bos_id: int | None = None) -> None:
        self._backend = backend
        cfg = dict(config or {})
        self._add_bos: bool | None = cfg.get("add_bos_token")
        self._add_eos: bool | None = cfg.get("add_eos_token")
        bos = self._id_of(cfg.get("bos_token"))
        self.bos_token_id: int | None = bos if bos is not None else extra_bos_id
        eos = self._eos_id = self._id_of(cfg.get("eos_token"))
        self.eos_token_ids: frozenset[int] = frozenset(
            [*([eos] if eos is not None else []), *extra_eos_ids])
        self.chat_template: str | None = _pick_template(cfg.get("chat_template"))
        self.bos_token: str | None = _token_content(cfg.get("bos_token"))  # for chat templates
        self.eos_token: str | None = _token_content(cfg.get("eos_token"))
        named = (self._id_of(cfg.get(f"{k}_token")) for k in ("bos", "eos", "pad", "unk"))
        self._special = frozenset(_backend_special_ids(backend)) | frozenset(
            i for i in named if i is not None)
        self.model_dir: Path | None = None  # the model directory it was read from (resolved), if one

    def is_from(self, model_dir: str | Path) -> bool:
        """It was read from ``model_dir`` (``from_model_dir``): what start-up's check loaded can serve the engine."""
        return self.model_dir is not None and self.model_dir == Path(model_dir).resolve()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, section: Mapping[str, Any] | None = None
                       ) -> Tokenizer:
        """Load a model directory's tokenizer, as its yaml `processor.tokenizer` section says."""
        tokenizer = from_yaml_tokenizer_section(model_dir, section) if section else cls.from_files(model_dir)
        tokenizer.model_dir = Path(model_dir).resolve()
        return tokenizer

    @classmethod
    def from_files(cls, model_dir: str | Path, tokenizer_file: str | Path = "tokenizer.json"
                   ) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config / generation_config / config.json)."""
        model_dir = Path(model_dir)
        path = model_dir / tokenizer_file
        if not path.is_file():
            raise TokenizerLoadError(f"tokenizer file not found: {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerLoadError(f"cannot load tokenizer {path}: {exc}") from exc
        finally:
            give_back()  # the parse's freed memory (Gemma 3's tokenizer.json: 290 MiB), heap.py
        config = _read_json(model_dir / "tokenizer_config.json")
        if not config.get("chat_template") and (model_dir / "chat_template.jinja").is_file():
            config["chat_template"] = (model_dir / "chat_template.jinja").read_text()
        return cls(backend, config, _eos_ids_from_files(model_dir), _bos_id_from_files(model_dir))

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; ``add_special_tokens`` False: none of the BOS/EOS the tokenizer would add."""
        if not add_special_tokens or (self._add_bos is None and self._add_eos is None):
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = list(self._backend.encode(text, add_special_tokens=False).ids)
        bos = self.bos_token_id
        if self._add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        if self._add_eos and self._eos_id is not None:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str | None:
        """The tokenizer.json text (what llguidance builds its tokenizer from); None without one."""
        to_str = getattr(self._backend, "to_str", None)
        return to_str() if to_str is not None else None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def token_text(self, token_id: int) -> str:
        """One token's display text, specials included (`<|im_end|>`); a token holding only
        part of a UTF-8 character shows as U+FFFD, as in TGI's per-token `text`."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is ``text`` (an added token such as ``<think>``), None if none is."""
        return self._id_of(text)

    def token_str(self, token_id: int) -> str:
        """One token's vocabulary string (a byte-level piece such as ``Ġthe``), as HF's
        ``convert_ids_to_tokens``; the decoded text where the tokenizer has no such table."""
        id_to_token = getattr(self._backend, "id_to_token", None)
        piece = id_to_token(token_id) if id_to_token is not None else None
        return piece if piece is not None else self.token_text(token_id)

    def _id_of(self, token: Any) -> int | None:
        if isinstance(token, Mapping):  # HF serialises AddedToken as {"content": ...}
            token = token.get("content")
        if not isinstance(token, str):
            return None
        return self._backend.token_to_id(token)


class IncrementalDetokenizer:
    """Per-request streaming text (TGI's prefix_offset/read_offset scheme).

    push() returns the newly completed text, or "" while the pending bytes do not yet form whole
    UTF-8 characters, so no chunk ever holds half a character. Special tokens are skipped by
    default (as in TGI's generated_text): the pushes plus flush() concatenate to
    `tokenizer.decode(generated_ids)`. Per-token display text is `Tokenizer.token_text(id)`.
    `prompt_ids` (its last few) give decoders that strip a leading space their left context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, context: int = 5) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-context:]) if context else []
        self._prefix = 0  # start of the window already emitted (kept as decoding context)
        self._read = len(self._ids)  # end of the emitted part

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT):
            return ""  # nothing new, or the last character is still incomplete
        del self._ids[:self._read]  # the new window starts at the old read offset
        self._prefix, self._read = 0, len(self._ids)
        return text[len(emitted):]

    def flush(self) -> str:
        """Text still held back at the end of the stream (U+FFFD if it ended mid-character)."""
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(emitted):]

    def _decode(self, start: int, stop: int) -> str:
        return self._tok.decode(self._ids[start:stop], skip_special_tokens=self._skip)


def from_yaml_tokenizer_section(model_dir: str | Path, section: Mapping[str, Any]) -> Tokenizer:
    """Build the tokenizer a predict yaml's `processor.tokenizer` section describes."""
    model_dir = Path(model_dir)
    if section.get("tokenizer_file"):
        return Tokenizer.from_files(model_dir, section["tokenizer_file"])
    vocab_file = section.get("vocab_file")
    if vocab_file:
        return _from_mindformers(model_dir, model_dir / vocab_file)
    if (model_dir / "tokenizer.json").is_file():
        return Tokenizer.from_files(model_dir)
    raise TokenizerLoadError(f"the yaml's processor.tokenizer in {model_dir} names neither "
                             "tokenizer_file nor vocab_file, and there is no tokenizer.json")


def _from_mindformers(model_dir: Path, vocab_file: Path) -> Tokenizer:
    try:
        import mindformers  # optional: only sentencepiece-style yamls need it
    except ImportError as exc:
        raise TokenizerLoadError(
            f"the yaml names only vocab_file {vocab_file}; loading it needs MindFormers "
            "(pip install mindformers), or add a tokenizer.json and set tokenizer_file") from exc
    log.info("loading tokenizer %s through mindformers.AutoTokenizer", vocab_file)
    tok = mindformers.AutoTokenizer.from_pretrained(str(model_dir))
    config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token,
              "chat_template": getattr(tok, "chat_template", None)}
    return Tokenizer(_MindformersBackend(tok), config, _eos_ids_from_files(model_dir),
                     _bos_id_from_files(model_dir))


class _MindformersBackend:
    """A MindFormers (HF-style) tokenizer behind the subset of the `tokenizers` API used above."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        return SimpleNamespace(ids=list(self._tok.encode(text, add_special_tokens=add_special_tokens)))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.convert_tokens_to_ids(token)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self._tok)

    def special_ids(self) -> set[int]:
        return set(self._tok.all_special_ids)


def _backend_special_ids(backend: Any) -> set[int]:
    if isinstance(backend, tokenizers.Tokenizer):
        return {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return backend.special_ids()


def _token_content(token: Any) -> str | None:
    if isinstance(token, Mapping):  # HF serialises AddedToken as {"content": ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):  # HF's named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def _eos_ids_from_files(model_dir: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return ids


def _bos_id_from_files(model_dir: Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("bos_token_id")
        if isinstance(value, int):
            return value
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerLoadError(f"{path} is not valid JSON: {exc}") from exc
