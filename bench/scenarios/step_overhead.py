"""Per-step overhead of the AOT path, before and after: one decode step at B=1 and B=16 (context ~100), and 15
rows beside a 64-token prompt chunk (the step that prefills under load), of two source trees (e.g. main and a
branch), measured in child processes that alternate tree by tree, round by round, so both see the same load on a
shared box.

    python -m bench step-overhead --tree before=/work/main --tree after=. [--rounds 3] [--json out.json] [--save]

Each child loads the default model from its tree (or ``--model-dir``'s) with the engine-speed configuration
(max_seq_len 2048, block 128, batch 16) but a small cache (33 blocks), compiles the three graphs, then alternates
B=1, B=16 (one 128-token block each, position 100) and 15+64 (15 of those rows and a prompt chunk of 64 tokens
from position 0) for ``--reps`` repetitions of ``--steps`` steps, reading the AOT kernels' own counters
(``kernel_stats``: calls and time inside each kernel kind) around each; the rest of a step is MindSpore's dispatch
of its ops, its stock ops and the host side. A last pass under the MindSpore CPU profiler counts the ops launched
per step by type. Each measurement records the cores other processes used meanwhile and the 1-minute load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness.paths import REPO
from bench.scenarios.engine_speed import CpuMeter, _parse_profile

# A child runs this module from this checkout (cwd: the tree measured, whose backends it imports).
CHILD = (f"import sys; sys.path.insert(0, {str(REPO)!r}); "
         "from bench.scenarios.step_overhead import main; main(sys.argv[1:])")
MIXED = 79  # the key of the mixed step: 15 decode rows and a 64-token prompt chunk


def child(tree: Path, steps: int, reps: int, profile_steps: int, model_dir: str | None = None) -> dict:
    sys.path.insert(0, str(tree))  # its backends; bench (this module, the harness) is already this checkout's
    import mindspore
    from mindspore.profiler import ProfilerActivity
    from backends.mindspore.kernels import KERNEL_KINDS, kernel_stats
    from backends.mindspore.runners.step import DecodeRow, PrefillChunk

    model = Path(model_dir) if model_dir else harness.default_model_dir(tree / ".cache" / "models")
    engine = harness.engine(model, warmup=False, progress=False, max_seq_len=2048, max_input_tokens=1536,
                            max_batch_size=16, block_size=128, prefill_chunk=64, num_blocks=33, kernels="aot")
    runner = engine.runner
    batches = {b: [DecodeRow(7, 100, engine.allocator.allocate(128)) for _ in range(b)] for b in (1, 16)}
    # 15 of those rows beside a 64-token prompt chunk (position 0, its own block): a step that prefills under load
    prompt = PrefillChunk([7 + i % 50 for i in range(64)], 0, engine.allocator.allocate(128))
    step_calls = {1: lambda: runner.decode(batches[1]), 16: lambda: runner.decode(batches[16]),
                  MIXED: lambda: runner.prefill([r.chunk() for r in batches[16][:15]] + [prompt])}
    for call in step_calls.values():
        call()  # compile
    out: dict = {"tree": str(tree), "git": _git(tree), "samples": {b: [] for b in step_calls}, "ops": {}}
    for _ in range(reps):
        for b, call in step_calls.items():
            for kind in KERNEL_KINDS:
                kernel_stats(reset=True, kind=kind)
            with CpuMeter() as m:
                for _ in range(steps):
                    call()
            kinds = {}
            for kind in KERNEL_KINDS:
                calls, sec = kernel_stats(kind=kind)
                kinds[kind] = {"ms": sec / steps * 1e3, "calls": calls / steps}
            out["samples"][b].append({"step_ms": m.wall / steps * 1e3, "kinds": kinds, "other_cores": m.other_cores,
                                      "loadavg": os.getloadavg()[0]})
    for b, call in step_calls.items():
        with tempfile.TemporaryDirectory(prefix="ms_prof_") as d:
            with mindspore.profiler.profile(activities=[ProfilerActivity.CPU],
                                            on_trace_ready=mindspore.profiler.tensorboard_trace_handler(d)):
                for _ in range(profile_steps):
                    call()
            out["ops"][b] = _parse_profile(d, profile_steps).get("by_type", {})
    return out


def _git(tree: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True,
                              text=True, check=True).stdout.strip()[:90]
    except (OSError, subprocess.CalledProcessError):
        return "?"


def summarize(name: str, runs: list[dict]) -> list[str]:
    lines = [f"{name}: {runs[0]['git']}"]
    for b in ("1", "16", str(MIXED)):
        samples = [s for r in runs for s in r["samples"][b]]
        step = statistics.median(s["step_ms"] for s in samples)
        kinds = {k: statistics.median(s["kinds"][k]["ms"] for s in samples) for k in samples[0]["kinds"]}
        calls = {k: samples[0]["kinds"][k]["calls"] for k in samples[0]["kinds"]}
        rest = statistics.median(s["step_ms"] - sum(v["ms"] for v in s["kinds"].values()) for s in samples)
        ops = runs[-1]["ops"].get(b, {})
        total_ops = sum(v["calls_per_step"] for v in ops.values())
        label = "15+64" if b == str(MIXED) else f"B={b:>2}"
        lines.append(f"  {label}: step {step:6.2f} ms (median of {len(samples)}, min "
                     f"{min(s['step_ms'] for s in samples):.2f}); inside kernels: "
                     + ", ".join(f"{k} {kinds[k]:.2f} ({calls[k]:.0f} calls)" for k in kinds)
                     + f"; rest {rest:.2f} ms")
        lines.append(f"        ops per step {total_ops:.0f}: "
                     + ", ".join(f"{t} {v['calls_per_step']:.0f}" for t, v in sorted(ops.items(),
                                                                               key=lambda kv: -kv[1]["calls_per_step"]))
                     + "; other cores " + " ".join(f"{s['other_cores']:.2f}" for s in samples)
                     + "; loadavg " + " ".join(f"{s['loadavg']:.2f}" for s in samples))
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH", help="a source tree to measure")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--model-dir", default=None,
                    help="a converted model directory (e.g. convert-gguf of the 1.7B Q4_K_M file) instead of the "
                         "default model")
    harness.add_output_arguments(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child).resolve(), args.steps, args.reps, args.profile_steps,
                               args.model_dir)))
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    if not trees:
        ap.error("give at least one --tree NAME=PATH")
    runs: dict[str, list[dict]] = {n: [] for n in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", CHILD, "--child", trees[name], "--steps", str(args.steps),
                                   "--reps", str(args.reps), "--profile-steps", str(args.profile_steps),
                                   *(["--model-dir", args.model_dir] if args.model_dir else [])],
                                  cwd=trees[name], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {time.perf_counter() - t:.0f} s, loadavg {os.getloadavg()[0]:.2f}",
                  flush=True)
    harness.save_results(args, "step-overhead", runs)
    print(f"step_overhead: {args.rounds} rounds x {args.reps} reps x {args.steps} decode steps, context ~100, "
          f"{os.cpu_count()} CPUs")
    for name, rs in runs.items():
        print("\n".join(summarize(name, rs)))


if __name__ == "__main__":
    main()
