"""What a start does once, not twice (issue 36's second start): the tokenizer start-up's check reads is the engine's
(another model directory's is not), the tokenizer.json text for grammars is made on first use only, the objects
alive before the warm-up are out of MindSpore's per-compile gc passes, and serve's early import of the engine."""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from backends.grammar import GrammarCompiler
from backends.mindspore.engine import engine_parts
from backends.mindspore.engine.collector import older_objects_frozen
from backends.mindspore.engine.preflight import check_model
from backends.mindspore.modeldir.tokenizer import Tokenizer
from backends.settings import EngineConfig
from backends.types import Grammar

REPO = Path(__file__).resolve().parents[3]
TINY = EngineConfig(max_seq_len=128, max_input_tokens=100, max_batch_size=4, max_iter_times=64,
                    block_size=16, prefill_chunk=16, window_buckets=(32, 128), batch_buckets=(1, 4))


@pytest.fixture()
def reads(monkeypatch) -> list[Path]:
    """Every model directory a ``Tokenizer.from_files`` call reads from, in order."""
    seen: list[Path] = []
    real = Tokenizer.from_files.__func__

    def counting(cls, model_dir, *args, **kwargs):
        seen.append(Path(model_dir))
        return real(cls, model_dir, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "from_files", classmethod(counting))
    return seen


def test_the_checked_tokenizer_is_the_engines(tiny_model_dir, reads):
    checked = check_model(tiny_model_dir, TINY)
    assert checked.tokenizer is not None and checked.tokenizer.is_from(tiny_model_dir)
    assert len(reads) == 1
    parts = engine_parts.build_parts(tiny_model_dir, TINY, tokenizer=checked.tokenizer)
    assert parts.tokenizer is checked.tokenizer
    assert len(reads) == 1  # parsed once in all


def test_a_tokenizer_of_another_directory_is_not_taken(tiny_model_dir, tiny_qwen2_dir, reads):
    other = Tokenizer.from_model_dir(tiny_qwen2_dir)
    parts = engine_parts.build_parts(tiny_model_dir, TINY, tokenizer=other)
    assert parts.tokenizer is not other and parts.tokenizer.is_from(tiny_model_dir)
    assert reads == [tiny_qwen2_dir, tiny_model_dir]


def test_is_from_compares_resolved_directories(tiny_model_dir, tmp_path):
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    link = tmp_path / "link"
    link.symlink_to(tiny_model_dir)
    assert tok.is_from(link) and tok.is_from(Path(tiny_model_dir) / ".." / Path(tiny_model_dir).name)
    assert not tok.is_from(tmp_path)


def test_grammar_tokenizer_json_is_made_on_first_use(tiny_model_dir):
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    calls: list[int] = []

    def text() -> str | None:
        calls.append(1)
        return tok.to_json()

    grammars = GrammarCompiler(text, tok.vocab_size, tok.eos_token_ids)
    assert calls == []
    grammars.compile(Grammar("regex", "[a-z]+"))
    grammars.compile(Grammar("regex", "[0-9]+"))
    assert calls == [1]


def test_older_objects_are_frozen_during_the_warm_up_only():
    assert gc.get_freeze_count() == 0
    with older_objects_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_by_someone_else_is_left_alone(monkeypatch):
    """Neither frozen again nor unfrozen (the count itself may drop meanwhile: frozen objects another thread frees)."""
    calls: list[str] = []
    gc.freeze()
    try:
        with monkeypatch.context() as patched:
            patched.setattr(gc, "freeze", lambda: calls.append("freeze"))
            patched.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
            with older_objects_frozen():
                pass
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_warm_up_compiles_with_older_objects_frozen(tiny_model_dir):
    from backends.mindspore.engine.engine import Engine

    frozen: list[int] = []
    with Engine(tiny_model_dir, TINY, warmup=False) as engine:
        real = engine.runner.warmup
        engine.runner.warmup = lambda progress: (frozen.append(gc.get_freeze_count()), real(progress))
        engine.parts.warm_up(progress=False)
    assert frozen and frozen[0] > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.slow  # a fresh process imports MindSpore
def test_preload_imports_the_engine_modules():
    code = ("import sys; from backends.loader import preload_backend; "
            "assert 'mindspore' not in sys.modules; preload_backend().join(); "
            "print('backends.mindspore.engine.engine' in sys.modules and 'mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
