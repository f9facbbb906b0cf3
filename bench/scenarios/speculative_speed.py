"""Prompt-lookup speculative decoding on the default model, through the engine: one engine with speculation on,
each workload run alternately with it (``speculate`` true) and without it (the per-request opt-out, the same
graphs), so the shared box's drift falls on both; reported as tokens/s and the on/off ratio per round, and
their median. Greedy outputs are checked equal on and off.

    python -m bench speculative-speed [--rounds 3] [--tokens 160] [--draft 8] [--clients 16] [--json out.json]
                                      [--save] [--draft-model DIR]

--draft-model: draft with that model (plugin_type draft_model) instead of prompt lookup; each round also
reports the process's CPU seconds per token on and off (every thread of the process: less sensitive to the
other jobs on the box than wall time).

Workloads: ``quote`` (a chat asking to repeat a passage word for word: the answer copies the prompt),
``story`` (free story continuation, greedy: nothing to copy but what the model repeats itself), ``sampled``
(the story sampled at temperature 0.9, seeded), ``c1-quote`` (serve_bench's c1-quote requests, one at a time,
each to its EOS within 160 tokens: the served bar's workload at the engine), ``c1-code`` (serve_bench's c1-code
requests the same way: edit a source file given in the prompt, each to its EOS within 320 tokens), and, with
--clients N, ``story`` with N requests at once.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from backends.mindspore.runners.step import PrefillChunk
from backends.settings import SpeculationSettings
from backends.types import RequestParams
from bench import harness
from bench.serving.code_edits import CODE_NEW_TOKENS, build_code_prompts
from bench.serving.scenarios import QUOTE_NEW_TOKENS, build_quote_prompts

if TYPE_CHECKING:
    from backends.mindspore.engine.engine import Engine

PASSAGE = ("The committee met on Tuesday to review the harbour repairs. The north wall, damaged in the March storms, "
           "has been rebuilt with granite blocks from the old quarry, and the fishing boats returned to their "
           "moorings last week. Work on the south pier will begin in June, once the tides are lower, and the "
           "council expects it to be finished before the autumn festival. Residents are asked to keep clear of "
           "the slipway while the cranes are working, and to report any loose stones to the harbour office.")
QUOTE = (f"<|im_start|>user\nRepeat the following passage exactly, word for word.\n\n{PASSAGE}<|im_end|>\n"
         "<|im_start|>assistant\n")
STORY = ("<|im_start|>user\nWrite a short story about a fox who finds a lantern in the snow.<|im_end|>\n"
         "<|im_start|>assistant\n")


def timed(engine: Engine, prompts: list[str], params: RequestParams, one_by_one: bool = False
          ) -> tuple[float, int, list]:
    """(seconds, generated tokens, results) of ``prompts`` submitted at once (or ``one_by_one``, each after the
    previous one's result, as a single client sends them)."""
    started = time.perf_counter()
    if one_by_one:
        results = [engine.submit(p, params).result(timeout=1800) for p in prompts]
    else:
        handles = [engine.submit(p, replace(params, seed=(params.seed or 0) + i or None))
                   for i, p in enumerate(prompts)]
        results = [h.result(timeout=1800) for h in handles]
    return time.perf_counter() - started, sum(r.generated_tokens for r in results), results


def step_costs(engine: Engine, rounds: int = 15, at: int | None = None) -> dict[int, float]:
    """Median seconds of one packed step of one row of 1, 2, 4, 8 and 16 tokens (a decode row and a verify
    row of 1..15 drafts) from position ``at`` (None: the window's end, the most attention reads), interleaved,
    on the scratch block only (as the warm-up writes)."""
    window = engine.runner.shapes.max_window
    blocks = [0] * (window // engine.runner.shapes.block_size)
    sizes = [n for n in (1, 2, 4, 8, 16) if n in engine.runner.shapes.prefill_sizes]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            chunk = PrefillChunk([0] * n, window - n if at is None else min(at, window - n), blocks, logit_tokens=n)
            started = time.perf_counter()
            engine.runner.prefill([chunk])
            times[n].append(time.perf_counter() - started)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--draft", type=int, default=8, help="decoding_length")
    ap.add_argument("--clients", type=int, default=0, help="also N story requests at once (0: skip)")
    ap.add_argument("--only", nargs="*", help="run only these workloads")
    ap.add_argument("--step-at", type=int, nargs="*", default=[],
                    help="also time the one-row steps from these positions (default: the window's end only)")
    harness.add_output_arguments(ap)
    ap.add_argument("--draft-model", type=Path, help="a same-tokenizer model directory drafting instead of n-grams")
    ap.add_argument("--model", type=Path, help="the model directory (default: the default model's fp32 conversion; "
                    "serve_bench's as-shipped target: its WORKDIR/models/as-shipped)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    batch = max(16, args.clients)
    engine = harness.engine(args.model, max_seq_len=1024, max_input_tokens=512, max_batch_size=batch,
                            max_iter_times=max(args.tokens, QUOTE_NEW_TOKENS, CODE_NEW_TOKENS),
                            block_size=64, prefill_chunk=64, graph_cache=True,
                            speculation=SpeculationSettings(max_draft=args.draft, draft_model=args.draft_model)
                            ).start()
    greedy = RequestParams(max_new_tokens=args.tokens, do_sample=False, ignore_eos=True)
    workloads = {"quote": ([QUOTE], greedy), "story": ([STORY], greedy),
                 "sampled": ([STORY], replace(greedy, do_sample=True, temperature=0.9, seed=7)),
                 "c1-quote": (build_quote_prompts(), RequestParams(max_new_tokens=QUOTE_NEW_TOKENS, do_sample=False)),
                 "c1-code": (build_code_prompts(), RequestParams(max_new_tokens=CODE_NEW_TOKENS, do_sample=False))}
    if args.clients:
        workloads[f"story_x{args.clients}"] = ([STORY] * args.clients, greedy)
    timed(engine, [STORY], replace(greedy, max_new_tokens=8))  # first-request costs out of the way
    costs = step_costs(engine)
    print("one-row step: " + ", ".join(f"{n} tokens {1e3 * t:.1f} ms (x{t / costs[1]:.2f})" for n, t in costs.items()),
          flush=True)
    report: dict[str, dict] = {"step_ms": {n: 1e3 * t for n, t in costs.items()}}
    for at in args.step_at:
        there = step_costs(engine, at=at)
        print(f"one-row step from position {at}: " + ", ".join(f"{n} tokens {1e3 * t:.1f} ms (x{t / there[1]:.2f})"
                                                             for n, t in there.items()), flush=True)
        report[f"step_ms_at_{at}"] = {n: 1e3 * t for n, t in there.items()}
    for name, (prompts, params) in workloads.items():
        if args.only and name not in args.only:
            continue
        rows = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            rates, outs, cpu = {}, {}, {}
            for on in order:
                before = engine.speculator.stats.describe()
                cpu_before = time.process_time()
                secs, tokens, results = timed(engine, prompts, replace(params, speculate=on),
                                                name.startswith("c1-"))
                cpu[on] = (time.process_time() - cpu_before) / tokens
                after = engine.speculator.stats.describe()
                rates[on], outs[on] = tokens / secs, [[t.id for t in res.tokens] for res in results]
                if on:
                    drafted = after["drafted_tokens"] - before["drafted_tokens"]
                    accepted = after["accepted_tokens"] - before["accepted_tokens"]
                    steps = after["verify_steps"] - before["verify_steps"]
            assert outs[True] == outs[False], f"{name}: speculation changed the output"
            rows.append({"on_tok_s": rates[True], "off_tok_s": rates[False], "ratio": rates[True] / rates[False],
                         "cpu_ms_per_token_on": 1e3 * cpu[True], "cpu_ms_per_token_off": 1e3 * cpu[False],
                         "drafted": drafted, "accepted": accepted, "verify_rows": steps})
            print(f"{name:12s} round {r}: on {rates[True]:7.1f} tok/s  off {rates[False]:7.1f} tok/s  "
                  f"x{rates[True] / rates[False]:.2f}  CPU {1e3 * cpu[True]:.1f} / {1e3 * cpu[False]:.1f} ms/token  "
                  f"(accepted {accepted}/{drafted} drafts in {steps} verify rows)", flush=True)
        ratio = statistics.median(row["ratio"] for row in rows)
        report[name] = {"rounds": rows, "median_ratio": ratio}
        print(f"{name:12s} median on/off x{ratio:.2f}", flush=True)
    engine.close()
    harness.save_results(args, "speculative-speed", {
        "draft": args.draft, "tokens": args.tokens, "workloads": report,
        "draft_model": str(args.draft_model) if args.draft_model else None})


if __name__ == "__main__":
    main()
