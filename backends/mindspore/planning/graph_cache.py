"""MindSpore's compile cache for the warm-up graphs, in a directory of its own per everything that shapes them.

MindSpore saves each compiled graph (``compile_cache_<i>.mindir``, i the order of compilation in the process)
and loads them back on the next start, which turns a restart's warm-up from compiling into loading. It does not
notice on its own when the network's code, the model, the compiled shapes or the kernel build change, so the
directory is named by a digest of all of them: a change anywhere is a new directory, never a stale graph.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from importlib import resources
from pathlib import Path

log = logging.getLogger("mindserve.engine")

_MODEL_FILES = ("config.json", "generation_config.json", "conversion.json")


def default_graph_cache_root() -> Path:
    return Path.home() / ".cache" / "mindserve" / "graphs"


def graph_key(parts: list[str], model_dir: Path, yaml_path: Path | None) -> str:
    """Digest of ``parts`` (shapes, dtype, cache size, kernel build, ...), the model directory's config files,
    yaml and safetensors headers (every weight's name, dtype and shape), and the source of the network code
    (every module of backends.mindspore)."""
    import mindspore as ms

    digest = hashlib.sha256()
    for part in (*parts, ms.__version__):
        digest.update(str(part).encode() + b"\0")
    for path in [model_dir / name for name in _MODEL_FILES] + ([yaml_path] if yaml_path else []):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for weights in sorted(model_dir.glob("*.safetensors")):
        digest.update(weights.name.encode() + b"\0" + _safetensors_header(weights) + b"\0")
    for name, data in sorted(_python_sources(resources.files("backends.mindspore"))):
        digest.update(name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()[:24]


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (u64 little-endian length, then the header), capped at 64 MB."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return f.read(min(size, 64 << 20))


def _python_sources(folder, prefix: str = ""):
    """(relative name, bytes) of every .py file under ``folder``."""
    for entry in folder.iterdir():
        if entry.is_dir() and entry.name != "__pycache__":
            yield from _python_sources(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(".py"):
            yield prefix + entry.name, entry.read_bytes()


_process = {"warmed_up": False, "cache_on": False}  # this process: an engine compiled already; the cache is on


def cache_for_this_warm_up(wanted: bool) -> bool:
    """Whether the warm-up about to run may use the compile cache: only the first engine's of the process (a
    second model of one server, or a model loaded again, would find graphs numbered after someone else's and
    load a wrong one). For any later warm-up the cache is turned off, if it was on."""
    first = not _process["warmed_up"]
    _process["warmed_up"] = True
    if not first and _process["cache_on"]:
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "0"  # read at each compile, as enable_graph_cache set it
        _process["cache_on"] = False
        log.info("graph cache off for this engine: not the first engine compiled in this process (MindSpore "
                 "numbers cached graphs by their order of compilation in the process)")
    return wanted and first


def enable_graph_cache(key: str, root: Path | None = None) -> Path | None:
    """Turn MindSpore's compile cache on in ``root``/``key`` (default under ~/.cache/mindserve/graphs) for the
    graphs compiled from now on; returns the directory. None, with the cache left off, when the process has no
    entry script file (``python -c``, an interactive session): MindSpore reads that file for its cache."""

    script = sys.argv[0] if sys.argv else ""
    if not script or not os.path.isfile(os.path.realpath(script)):
        log.info("graph cache off: this process has no entry script file (%r) for MindSpore's compile cache", script)
        return None

    where = (root or default_graph_cache_root()) / key
    where.mkdir(parents=True, exist_ok=True)
    cached = len(list(where.rglob("*.mindir")))
    # MindSpore 2.9 reads these at each compile; its set_context(enable_compile_cache=...) is deprecated (and warns).
    os.environ.update(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=str(where))
    _process["cache_on"] = True
    log.info("graph cache: %s (%s)", where, f"{cached} graphs cached" if cached
             else "empty: compiling, each graph saved for the next start")
    return where
