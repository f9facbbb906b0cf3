"""What LoRA adds to one decode step, on the default model through the runner (no HTTP, no scheduler):
the same packed decode step with every row on the base model, and with rows on adapters, interleaved
round by round so both see the same machine.

    .venv/bin/python -m bench lora-step [--rounds 30] [--steps 8] [--rank 8] [--kernels auto|aot|stock] [--save]

Cases: B=1 (base; one adapter) and B=16 (all base; 4 adapters + base in turn, 4 distinct adapters per
step). Four rank-``--rank`` adapters on all seven projections (tests/support/lora_adapters.py). Per case:
the median and the best of the per-step times over rounds, and the ratio adapter ÷ base (best and median),
with the machine's memory bandwidth (numpy, one thread) beside them. Never runs in the test suite.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness

ADAPTERS = ("a", "b", "c", "d")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per case per round")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--kernels", default="auto")
    harness.add_output_arguments(ap)
    args = ap.parse_args(argv)

    from backends.lora import BaseDims, load_adapter
    from backends.mindspore.families import load_model
    from backends.mindspore.engine.lora_slots import LoraSlots
    from backends.mindspore.runners.step import DecodeRow
    from tests.support.lora_adapters import make_adapter
    from tests.support.reference_numpy import RefModel

    model_dir = harness.default_model_dir()
    dims = BaseDims.of(load_model(model_dir))
    base = RefModel.from_dir(model_dir, dtype=np.float32).w
    runner = harness.runner(model_dir, num_blocks=80, kernels=args.kernels, lora=(len(ADAPTERS), args.rank),
                            block_size=64, prefill_chunk=32, batch_buckets=(1, 16), window_buckets=(256,),
                            prefill_batch_buckets=(1,))
    slots = LoraSlots(dims, len(ADAPTERS), args.rank, runner.write_lora)
    with tempfile.TemporaryDirectory() as tmp:
        for seed, name in enumerate(ADAPTERS, 1):
            make_adapter(Path(tmp) / name, dims, seed=seed, rank=args.rank, alpha=16, base_weights=base,
                         strength=0.1)
            slots.load(load_adapter(name, Path(tmp) / name, dims))
    print(f"kernels: {runner.description}; rank {args.rank}, {len(ADAPTERS)} adapters on all seven projections")

    def rows(batch: int, lora: list[int]) -> list[DecodeRow]:
        # row i decodes at position 100 in its own 4 blocks (blocks 1.. ; 0 is the scratch block)
        return [DecodeRow(5 + i, 100, list(range(1 + 4 * i, 5 + 4 * i)), lora[i]) for i in range(batch)]

    cases = {
        "B=1 base": rows(1, [-1]),
        "B=1 adapter": rows(1, [0]),
        "B=16 base": rows(16, [-1] * 16),
        "B=16 4 adapters + base": rows(16, [i % 5 - 1 for i in range(16)]),
    }
    for r in cases.values():  # compile and touch everything once
        runner.decode(r)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, r in cases.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                runner.decode(r)
            times[name].append((time.perf_counter() - t) / args.steps)
    machine = harness.machine_facts()
    bw = machine["memory_bandwidth"]["read_gbs"]
    print(f"memory bandwidth (numpy, 1 thread, read): {bw:.1f} GB/s; {args.rounds} rounds x {args.steps} steps")
    print(f"{'case':<26} {'median ms':>10} {'best ms':>9}")
    for name, ts in times.items():
        print(f"{name:<26} {statistics.median(ts) * 1e3:>10.2f} {min(ts) * 1e3:>9.2f}")
    for plain, mixed in (("B=1 base", "B=1 adapter"), ("B=16 base", "B=16 4 adapters + base")):
        med = statistics.median(times[plain]) / statistics.median(times[mixed])
        best = min(times[plain]) / min(times[mixed])
        print(f"throughput {mixed} ÷ {plain}: {best:.3f}x (best), {med:.3f}x (median)")
    harness.save_results(args, "lora-step", {"rank": args.rank, "steps": args.steps,
                                             "step_s": times, "kernels": runner.description}, machine=machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
