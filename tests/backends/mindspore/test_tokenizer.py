"""Tokenizer of the default model (rebuilt from GGUF metadata): ids, round trips, specials,
EOS/BOS facts, yaml tokenizer sections, and UTF-8-safe incremental detokenisation."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from backends.mindspore.modeldir.tokenizer import (IncrementalDetokenizer, Tokenizer, TokenizerLoadError,
                                                   from_yaml_tokenizer_section)

OLIVIER_IDS = [5965, 1462, 314, 11256, 380, 1153, 284, 339]
ROUND_TRIP = ["My name is Olivier and I", "Hello 12345 world", "  def f(x):\n\treturn x**2  ",
              "déjà vu, naïve café", "emoji 😀👍🏽 and 🇫🇷", "中文字符和日本語のテキスト", "", " ", "\n\n"]
MULTIBYTE = ["Hi 😀! 你好，世界。 👍🏽 🇫🇷 done", "مرحبا بالعالم", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 中文"]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


def test_olivier_prompt_ids_without_bos(tok: Tokenizer) -> None:
    assert tok.encode("My name is Olivier and I") == OLIVIER_IDS


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_individually(tok: Tokenizer) -> None:
    assert [tok.token_text(i) for i in tok.encode("12345")] == list("12345")


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and ids[-2] == 2
    assert tok.is_special(2) and tok.is_special(1) and tok.is_special(0)
    assert not any(tok.is_special(i) for i in OLIVIER_IDS)
    assert tok.token_text(2) == "<|im_end|>"
    assert tok.decode(ids) == "user\nhi\n"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_ids_facts(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152


def test_chat_template_present(tok: Tokenizer) -> None:
    assert tok.chat_template is not None
    assert "<|im_start|>" in tok.chat_template and "SmolLM" in tok.chat_template


def test_token_text_of_a_partial_character_is_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1 and tok.token_text(ids[0]) == "\ufffd"


@pytest.mark.parametrize("text", MULTIBYTE)
def test_incremental_detokenizer_never_splits_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == text
    if any(ord(c) > 0xFFFF for c in text):
        assert "" in pieces  # a 4-byte character spread over several tokens was held back


def test_incremental_detokenizer_with_prompt_context(tok: Tokenizer) -> None:
    ids = tok.encode(" Olivier 😀 and I")
    detok = IncrementalDetokenizer(tok, prompt_ids=OLIVIER_IDS)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == " Olivier 😀 and I"


def test_incremental_detokenizer_specials(tok: Tokenizer) -> None:
    ids = tok.encode("Sure 😀<|im_end|>")
    skipping, keeping = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(skipping.push(i) for i in ids) == "Sure 😀"
    assert "".join(keeping.push(i) for i in ids) == "Sure 😀<|im_end|>"


def test_flush_returns_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in ids[:-1])
    rest = detok.flush()
    assert streamed == "ok" and rest.endswith("\ufffd")  # the stream really ended mid-character
    assert streamed + rest == tok.decode(ids[:-1])


def _copy_tokenizer_files(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_yaml_section_with_tokenizer_file(default_model_dir: Path) -> None:
    section = {"type": "PreTrainedTokenizerFast", "tokenizer_file": "tokenizer.json"}
    assert from_yaml_tokenizer_section(default_model_dir, section).encode("My name is Olivier and I") \
        == OLIVIER_IDS


def test_yaml_section_sentencepiece_needs_mindformers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mindformers", None)  # make `import mindformers` fail
    section = {"type": "LlamaTokenizer", "vocab_file": "tokenizer.model"}
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.model.*MindFormers"):
        from_yaml_tokenizer_section(tmp_path, section)


def test_missing_tokenizer_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_eos_ids_are_the_union_of_the_config_files(default_model_dir: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer_files(default_model_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_model_dir(d).eos_token_ids == frozenset({0, 2})


def test_add_bos_token_in_config_is_respected(default_model_dir: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer_files(default_model_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    tok = Tokenizer.from_model_dir(d)
    assert tok.encode("My name is Olivier and I") == [1, *OLIVIER_IDS]
    assert tok.encode("<|im_start|>user")[:2] == [1, 4093]  # BOS not doubled
