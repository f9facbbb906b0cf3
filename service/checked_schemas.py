"""Which sets of schema files passed the JSON Schema meta-schema check already: one empty stamp file per set, named
by a digest of the files' bytes and the jsonschema version, so that a start does not check unchanged schemas again
(``check_schema`` over the 27 shipped files: 0.36 s of CPU on every start, before the ports open).

A stamp is written only after every file of the set passed; any change to a file, or another jsonschema, is another
digest and is checked again. Without a writable cache directory the files are simply checked at every start.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import jsonschema


def default_stamp_dir() -> Path:
    return Path.home() / ".cache" / "mindserve" / "checked-schemas"


def schema_set_key(texts: Mapping[str, str]) -> str:
    """The digest of a set of schema files (name -> text) and the jsonschema version that checks them."""
    digest = hashlib.sha256(f"jsonschema {jsonschema.__version__}\0".encode())
    for name in sorted(texts):
        digest.update(name.encode() + b"\0" + texts[name].encode() + b"\0")
    return digest.hexdigest()[:32]


def was_checked(key: str, stamp_dir: Path) -> bool:
    return (stamp_dir / key).is_file()


def mark_checked(key: str, stamp_dir: Path) -> None:
    """Stamp ``key`` as checked (written to a temporary name, then renamed); a directory we cannot write is no
    error: the next start checks again."""
    try:
        stamp_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=stamp_dir, prefix=".stamp-")
        os.close(fd)
        os.replace(tmp, stamp_dir / key)
    except OSError:
        pass
