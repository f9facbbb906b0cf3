"""The KV cache formats (kvCacheDtype) on the default model: accuracy against float32 and decode step time.

Accuracy, per format: greedy ids on the prompts below (the golden prompt of tests/golden/smollm2_greedy.json first)
against float32's, and the logit error with float32's own greedy continuation fed to both (teacher forcing: the
prompt's last logits, then one decode step per float32 token), max abs and mean abs over every logit.

Speed, per format: one decode step of 16 rows whose contexts are 100..475 tokens (25 apart), the formats taking
turns round by round (the box is shared), median over rounds of each round's median step: its wall time and the
CPU time this process spent on it (both kernel threads; less sensitive to other processes on a shared box). And
the paged attention kernel alone on the same rows (SmolLM2-135M's 9 heads, 3 kv heads, head_dim 64; one layer's
cache of those 16 sequences, called 30 times for the 30 layers; one kernel thread, CPU time).

    python -m bench kv-cache-dtype [--rounds 7] [--steps 20] [--json out.json] [--save] [--kernel-only]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.harness.machine import cpu_model
from bench.harness.paths import REPO

FORMATS = ("float32", "float16", "bfloat16", "q8_0")
NEW_TOKENS = 32
ROWS, CONTEXTS = 16, [100 + 25 * i for i in range(16)]
PROMPTS = [
    json.loads((REPO / "tests/golden/smollm2_greedy.json").read_text())["prompt"],
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue.",
    "the river ran past old stone walls while children counted boats and the baker sang about bread",
]


def engines(model_dir: Path) -> dict:
    config = dict(max_seq_len=640, max_input_tokens=512, max_batch_size=ROWS, max_iter_times=128, block_size=64,
                  batch_buckets=(1, ROWS), kernels="aot", cache_gb=1.0)
    return {f: harness.engine(model_dir, **config, kv_cache_dtype=f).start() for f in FORMATS}


def greedy(engine, prompt: str) -> tuple[list[int], list[int]]:
    from backends.types import RequestParams

    r = engine.generate(prompt, RequestParams(max_new_tokens=NEW_TOKENS, do_sample=False, decoder_input_details=True))
    return [t.id for t in r.prefill], [t.id for t in r.tokens]


def forced_logits(engine, prompt_ids: list[int], continuation: list[int]) -> np.ndarray:
    """Logits [len(continuation), V]: the prompt's last, then after each continuation token but the last."""
    from backends.mindspore.runners.step import DecodeRow, PrefillChunk

    runner, alloc = engine.runner, engine.allocator
    blocks = alloc.allocate(len(prompt_ids) + len(continuation))
    try:
        out = [runner.prefill([PrefillChunk(list(prompt_ids), 0, blocks)])[0][0]]
        for i, token in enumerate(continuation[:-1]):
            out.append(runner.decode([DecodeRow(token, len(prompt_ids) + i, blocks)])[0])
        return np.stack(out).astype(np.float64)
    finally:
        alloc.release(blocks)


def accuracy(eng: dict) -> dict:
    base = {p: greedy(eng["float32"], p) for p in PROMPTS}
    ref = {p: forced_logits(eng["float32"], *base[p]) for p in PROMPTS}
    out = {}
    for f in FORMATS:
        ids = {p: greedy(eng[f], p)[1] for p in PROMPTS}
        errs = np.concatenate([np.abs(forced_logits(eng[f], *base[p]) - ref[p]).ravel() for p in PROMPTS])
        first = [next((i for i, (a, b) in enumerate(zip(ids[p], base[p][1])) if a != b), None) for p in PROMPTS]
        out[f] = {"max_abs": float(errs.max()), "mean_abs": float(errs.mean()),
                  "golden_ids_match": ids[PROMPTS[0]] == base[PROMPTS[0]][1][:NEW_TOKENS],
                  "prompts_matching": sum(ids[p] == base[p][1] for p in PROMPTS), "prompts": len(PROMPTS),
                  "first_divergence": first}
    return out


def speed(eng: dict, rounds: int, steps: int) -> dict:
    from backends.mindspore.runners.step import DecodeRow

    seqs = {f: [e.allocator.allocate(c + 1) for c in CONTEXTS] for f, e in eng.items()}
    times = {f: [] for f in FORMATS}
    cpu = {f: [] for f in FORMATS}
    try:
        for f, e in eng.items():  # the caches' blocks written once, and every graph warm
            e.runner.decode([DecodeRow(7, c, b) for c, b in zip(CONTEXTS, seqs[f])])
        for r in range(rounds):
            order = FORMATS if r % 2 == 0 else FORMATS[::-1]
            for f in order:
                rows = [DecodeRow(7 + i, c, b) for i, (c, b) in enumerate(zip(CONTEXTS, seqs[f]))]
                step, step_cpu = [], []
                for _ in range(steps):
                    t, c = time.perf_counter(), time.process_time()
                    eng[f].runner.decode(rows)
                    step.append(time.perf_counter() - t)
                    step_cpu.append(time.process_time() - c)
                times[f].append(statistics.median(step) * 1e3)
                cpu[f].append(statistics.median(step_cpu) * 1e3)
    finally:
        for f, e in eng.items():
            for b in seqs[f]:
                e.allocator.release(b)
    return {f: {"step_ms_median": statistics.median(times[f]), "step_ms_rounds": times[f],
                "step_cpu_ms_median": statistics.median(cpu[f]), "step_cpu_ms_rounds": cpu[f]} for f in FORMATS}


def kernel_speed(rounds: int, steps: int) -> dict:
    """The attention kernel alone (ctypes), one thread: CPU ms for 30 layers' calls of 16 decode rows."""
    from backends.mindspore.kernels import kernel_library
    from tests.support import kv_ref

    lib = kernel_library()
    lib.mindserve_matmul_set_threads(1)
    h, kv, d, bs = 9, 3, 64, 64
    nb = -(-max(CONTEXTS) // bs) - 0 + 1
    blocks = ROWS * nb + 1
    rng = np.random.default_rng(0)
    table = (1 + np.arange(ROWS * nb, dtype=np.int32)).reshape(ROWS, nb)
    pos, rows = np.array(CONTEXTS, np.int32), np.arange(ROWS, dtype=np.int32)
    q = rng.standard_normal((ROWS, h, d)).astype(np.float32)
    out = np.zeros((ROWS, h * d), np.float32)
    caches = {f: [kv_ref.encode(rng.standard_normal((kv * blocks * bs, d)).astype(np.float32), f) for _ in "kv"]
              for f in FORMATS}
    cpu = {f: [] for f in FORMATS}
    for r in range(rounds):
        for f in (FORMATS if r % 2 == 0 else FORMATS[::-1]):
            k, v = caches[f]
            step = []
            for _ in range(steps):
                c = time.process_time()
                for _layer in range(30):
                    assert lib.mindserve_attention_kv_raw(q.ctypes.data, k.ctypes.data, v.ctypes.data,
                                                          table.ctypes.data, pos.ctypes.data, rows.ctypes.data,
                                                          out.ctypes.data, ROWS, ROWS, h, d, kv, blocks * bs, nb, bs,
                                                          kv_ref.CODES[f]) == 0
                step.append(time.process_time() - c)
            cpu[f].append(statistics.median(step) * 1e3)
    lib.mindserve_matmul_set_threads(2)
    return {f: {"attention_cpu_ms_median": statistics.median(t), "attention_cpu_ms_rounds": t} for f, t in cpu.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kernel-only", action="store_true", help="only the attention kernel's timing")
    harness.add_output_arguments(ap)
    args = ap.parse_args(argv)
    result = {"cpu": cpu_model(), "rows": ROWS, "contexts": [CONTEXTS[0], CONTEXTS[-1]]}
    if not args.kernel_only:
        eng = engines(harness.default_model_dir())
        try:
            result.update(accuracy=accuracy(eng), speed=speed(eng, args.rounds, args.steps),
                          kernel_variant=eng["float32"].runner.kernel_variant)
        finally:
            for e in eng.values():
                e.__exit__(None, None, None)
    result["kernel"] = kernel_speed(args.rounds, args.steps)
    print(f"CPU: {result['cpu']}; {ROWS} rows, contexts {CONTEXTS[0]}..{CONTEXTS[-1]}")
    print("| format | step ms (median) | step CPU ms | attention CPU ms | vs float32 | logit max abs | "
          "logit mean abs | golden ids = float32 | prompts = |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    a32 = result["kernel"]["float32"]["attention_cpu_ms_median"]
    for f in FORMATS:
        k = result["kernel"][f]["attention_cpu_ms_median"]
        if args.kernel_only:
            print(f"| {f} | | | {k:.2f} | {k / a32:.3f} | | | | |")
            continue
        a, s = result["accuracy"][f], result["speed"][f]
        print(f"| {f} | {s['step_ms_median']:.2f} | {s['step_cpu_ms_median']:.2f} | {k:.2f} | {k / a32:.3f} | "
              f"{a['max_abs']:.4g} | {a['mean_abs']:.3g} | {a['golden_ids_match']} | {a['prompts_matching']}/"
              f"{a['prompts']} |")
    harness.save_results(args, "kv-cache-dtype", result)


if __name__ == "__main__":
    main()
