"""A model step's quantized matmuls, kernel builds side by side: the default model's shapes (SmolLM2-135M: 30 layers of
Q4_1 q/k/v/o/gate/up/down, the Q8_0 tied head), distinct random weights per layer (96 MB, so nothing stays in
cache from one step to the next), in model order through ``mindserve_qmatmul_raw``; the builds alternate round by
round, and each reports its fastest and median step, and the packed weight bytes read a second at the fastest (the
formats' speed per byte read, comparable across formats).

    python bench/qmatmul_step.py TREE:VARIANT [TREE:VARIANT ...] [--rows 16 | --rows 1,2,4,8,16] [--threads 1]
        [--rounds 7] [--format q4_1] [--shape HIDDEN,FFN --layers 2] [--matrices qkv]

``--format`` stores the layers' matrices in another GGUF format (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k;
the K-quants written by quant.quantize); several, comma-separated (``--format q4_1,q4_k``), are timed round by round
alternately, like the builds. ``--shape HIDDEN,FFN`` times another model's layers instead, as the server
runs them: the fused qkv [H, 3H] (no GQA), o [H, H], the fused gate/up [H, 2F] and down [F, H], without the head
(e.g. ``--shape 2048,8192 --layers 2``: SmolLM2-1.7B, 2 layers of weights, still far more than the caches hold).
A format may give some parts another one, ``FMT:PART=FMT...`` with PART one of q, k, v, o, gate, up, down: a fused
matrix whose parts then differ is a segmented weight (kernels.prepare_qstack), e.g. Q4_K_M's qkv against it
requantized to Q6_K: ``--shape 2048,8192 --layers 2 --matrices qkv --format q4_k:v=q6_k,q6_k``. ``--matrices``
times only the named matrices of each layer (qkv, o, gate_up, down; without --shape: q, k, v, o, gate, up, down).

TREE is a source tree (e.g. /work/main and this one), VARIANT a kernel variant (``x86-64-v3``, ...); each build is
made by its own tree in a child process. With one thread the time is the thread's CPU time (``time.thread_time``),
which other processes on a shared box do not inflate; with more it is wall time.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from backends.mindspore.kernels import prepare_qstack  # noqa: E402

# (name, K, its parts (name, N)) of each matrix of a layer
LAYER = [("q", 576, [("q", 576)]), ("k", 576, [("k", 192)]), ("v", 576, [("v", 192)]), ("o", 576, [("o", 576)]),
         ("gate", 576, [("gate", 1536)]), ("up", 576, [("up", 1536)]), ("down", 1536, [("down", 576)])]
HEAD = (576, 49152)
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7}  # qmatmul.cc's codes


def load_build(spec: str, cache: str) -> ctypes.CDLL:
    tree, variant = spec.rsplit(":", 1)
    code = ("from backends.mindspore.kernels.build import build_kernel; "
            f"print(build_kernel({cache!r}, variant={variant!r}))")
    out = subprocess.check_output([sys.executable, "-c", code], cwd=tree, text=True,
                                  env={**os.environ, "PYTHONPATH": tree})
    lib = ctypes.CDLL(out.strip().splitlines()[-1])
    lib.mindserve_matmul_set_threads.argtypes = [ctypes.c_int]
    lib.mindserve_qmatmul_raw.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64] * 3
    lib.mindserve_qmatmul_raw.restype = ctypes.c_int
    if hasattr(lib, "mindserve_qmatmul_packed_raw"):  # segmented weights (trees before them have none)
        lib.mindserve_qmatmul_packed_raw.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [
            ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
        lib.mindserve_qmatmul_packed_raw.restype = ctypes.c_int
    return lib


def random_qweight(rng, fmts: list[str], rows: list[int], k: int) -> np.ndarray:
    """Parts of ``rows`` outputs each in its format, stacked (segmented where the formats differ)."""
    from backends.mindspore.modeldir.quant import quantize  # gguf's for the 32-blocks, its own for the K-quants

    return prepare_qstack([quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), f)
                           for f, n in zip(fmts, rows)])


def parse_format(spec: str) -> dict[str, str]:
    """``FMT[:PART=FMT...]`` -> {part: format} with "" the default."""
    base, *over = spec.split(":")
    out = {"": base, **dict(o.split("=", 1) for o in over)}
    bad = [f for f in out.values() if f not in FORMATS]
    if bad:
        raise ValueError(f"--format {spec!r}: {bad[0]!r} is not one of {', '.join(FORMATS)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", metavar="TREE:VARIANT")
    ap.add_argument("--rows", default="16", help="M, the activation rows; several comma-separated, each timed on the "
                    "same weights (default 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--format", default="q4_1", help="the layers' format(s), comma-separated (default q4_1)")
    ap.add_argument("--shape", help="HIDDEN,FFN: another model's fused layers, no head (default: SmolLM2-135M)")
    ap.add_argument("--matrices", help="only these matrices of each layer, comma-separated (no head)")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "mindserve-qmatmul-step"))
    args = ap.parse_args()
    libs = {spec: load_build(spec, args.cache) for spec in args.builds}
    for lib in libs.values():
        lib.mindserve_matmul_set_threads(args.threads)
    rng = np.random.default_rng(0)
    layer = LAYER
    if args.shape:
        hidden, ffn = (int(v) for v in args.shape.split(","))
        layer = [("qkv", hidden, [("q", hidden), ("k", hidden), ("v", hidden)]), ("o", hidden, [("o", hidden)]),
                 ("gate_up", hidden, [("gate", ffn), ("up", ffn)]), ("down", ffn, [("down", hidden)])]
    if args.matrices:
        keep = args.matrices.split(",")
        if set(keep) - {name for name, _, _ in layer}:
            ap.error(f"--matrices: use names of {[name for name, _, _ in layer]}")
        layer = [m for m in layer if m[0] in keep]
    try:
        formats = {spec: parse_format(spec) for spec in args.format.split(",")}
    except ValueError as e:
        ap.error(str(e))
    models = {}
    for spec, fmt in formats.items():
        mats = []
        for _ in range(args.layers):
            for _, k, parts in layer:
                fmts = [fmt.get(name, fmt[""]) for name, _ in parts]
                rows = [n for _, n in parts]
                mats.append((fmts[0] if len(set(fmts)) == 1 else None, k, sum(rows),
                             random_qweight(rng, fmts, rows, k)))
        if not args.shape and not args.matrices:
            mats.append(("q8_0", *HEAD, random_qweight(rng, ["q8_0"], [HEAD[1]], HEAD[0])))
        models[spec] = mats
    for rows in (int(r) for r in args.rows.split(",")):
        time_rows(libs, models, rows, args.threads, args.rounds, rng)


def time_rows(libs: dict, models: dict, rows: int, threads: int, rounds: int, rng) -> None:
    """Every build on every format's step at M = ``rows``, round by round alternately; the fastest and median step."""
    every = [m for mats in models.values() for m in mats]
    x = {k: rng.standard_normal((rows, k)).astype(np.float32) for _, k, _, _ in every}
    y = np.empty((rows, max(n for _, _, n, _ in every)), np.float32)
    clock = time.thread_time if threads == 1 else time.perf_counter
    for fmt, mats in models.items():
        print(f"{fmt}: {sum(m[3].nbytes for m in mats) / 1e6:.1f} MB of weights", end="; ")
    print(f"M={rows}, {threads} thread(s), {'CPU' if threads == 1 else 'wall'} time")
    runs = [(spec, fmt) for spec in libs for fmt in models]
    steps: dict[tuple, list[float]] = {r: [] for r in runs}
    heads: dict[tuple, list[float]] = {r: [] for r in runs}
    for _ in range(rounds):
        for spec, fmt in runs:
            lib = libs[spec]
            started = clock()
            for f, k, n, w in models[fmt]:
                head_started = clock()
                if f is None:  # a segmented weight
                    rc = lib.mindserve_qmatmul_packed_raw(x[k].ctypes.data, w.ctypes.data, w.shape[1], None,
                                                          y.ctypes.data, rows, k, n)
                else:
                    rc = lib.mindserve_qmatmul_raw(x[k].ctypes.data, w.ctypes.data, FORMATS[f], None, y.ctypes.data,
                                                   rows, k, n)
                assert rc == 0, rc
            ended = clock()
            steps[spec, fmt].append(ended - started)
            heads[spec, fmt].append(ended - head_started)
    for spec, fmt in runs:
        fastest = min(steps[spec, fmt])
        weight_bytes = sum(m[3].nbytes for m in models[fmt])
        print(f"{spec + ' ' + fmt:44s} step min {fastest * 1e3:7.2f} ms, "
              f"median {statistics.median(steps[spec, fmt]) * 1e3:7.2f}  (last matmul min "
              f"{min(heads[spec, fmt]) * 1e3:6.2f}, median {statistics.median(heads[spec, fmt]) * 1e3:6.2f}); "
              f"{weight_bytes / fastest / 1e9:5.2f} GB/s of weights at the fastest")


if __name__ == "__main__":
    main()
