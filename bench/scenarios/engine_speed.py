"""Engine speed on the default model (SmolLM2-135M-Instruct, fp32, MindSpore GRAPH_MODE on CPU).

One run measures: model load, warm-up compile (total and per graph), single-stream greedy decode
through the engine and through the runner / bare graph call, batched decode at B=4 and B=16,
chunked prefill of a 500-token prompt, the machine's memory read bandwidth (and the fp32
decode ceiling it implies), a per-op profile of a decode step, and peak RSS.

    python -m bench engine-speed [--rounds N] [--json out.json] [--save] [--chart step.png]
    python -m bench engine-speed --chart-from out.json [--chart step.png]     # redraw, no run

``--chart`` draws the decode-step breakdown (time inside each AOT kernel and the rest, B=1 and B=16) with
matplotlib (bench/harness/charts.py).

The box is small (2 vCPU) and often shared, so every timed measurement records how many cores
*other* processes used meanwhile (busy jiffies in /proc/stat minus this process's CPU time);
results are medians over interleaved rounds, "best" is the fastest round, and the ceiling/ratios
use the median of the "clean" samples (other processes < CLEAN_CORES) when there are any.
See docs/performance.md for the method and a reference run.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import harness
from bench.harness.machine import commit
from bench.harness.paths import REPO

BW_ARRAY_BYTES = 512 * 1024 * 1024
CLEAN_CORES = 0.3  # a sample is "clean" if other processes used fewer cores than this meanwhile
PROMPT_SHORT = 32
PROMPT_LONG = 500
NEW_TOKENS = 128
RAW_BATCH_STEPS = 48
RAW_WINDOW_STEPS = 24
LONG_CONTEXTS = (1024, 2048)  # B=1 decode measured late in these contexts
FULL_WARMUP_MAX_GRAPHS = 12  # compile the engine's whole plan when it is this small (the AOT path: ~6)
MATMUL_OPS = ("MatMul", "Custom")  # Custom = the AOT matmul kernel
WEIGHT_SUFFIXES = ("wqkv", "bqkv", "wo", "w_gate_up", "w_down", "lm_head")

# Prose used to build prompts of an exact token length (written for this benchmark).
PROSE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him, and when he reached the lamp room he wiped the salt from the glass before "
    "lighting the wick. Out on the water the fishing boats turned for home, their lanterns swaying, and "
    "the gulls settled on the rocks below the tower. He kept a logbook on the desk by the window: the "
    "wind, the state of the sea, the ships that passed and the hour they passed. Some nights nothing "
    "happened at all, and he wrote only the weather. Other nights the fog came in so thick that he rang "
    "the bell every half minute until dawn, his arms aching, listening for an answer from the dark. In "
    "winter the supply boat came once a fortnight with flour, lamp oil, letters and newspapers that were "
    "already old. He read them slowly, a page at a time, to make them last. His sister wrote about the "
    "town, the new school, the price of bread, the neighbour who had bought a motor car and drove it "
    "into the river. He wrote back about the seals, the storms, the ship that lost its mast in March and "
    "limped past the point under a scrap of sail. When spring arrived he painted the railings, mended the "
    "roof of the oil store, and planted potatoes in the sheltered corner behind the cottage where the "
    "wind could not reach them. Visitors sometimes rowed out on calm afternoons to see the lamp, and he "
    "showed them the lens, the clockwork that turned it, and the brass plate with the year the tower was "
    "built. Children asked whether he was lonely. He told them that the sea was never the same twice, "
    "that a keeper had more company than most people imagined, and that the light itself was a kind of "
    "conversation with every sailor who saw it. Years later, when the light was automated and the keeper "
    "moved to the mainland, he still woke at dusk and looked toward the point, waiting to see the beam "
    "sweep across the water, steady and patient, the way he had kept it for thirty years. "
)


# ----------------------------------------------------------------------------------------------
# contention accounting


def _proc_stat() -> tuple[int, int]:
    """(busy jiffies excluding steal, steal jiffies) summed over all CPUs."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq, steal


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


_HZ = os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Context manager: wall time, cores used by this process and by everything else."""

    def __enter__(self) -> "CpuMeter":
        self._busy, self._steal = _proc_stat()
        self._own, self._t = _own_cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t
        busy, steal = _proc_stat()
        own = _own_cpu() - self._own
        wall = max(self.wall, 1e-9)
        self.own_cores = own / wall
        self.other_cores = max(0.0, (busy - self._busy) / _HZ - own) / wall
        self.steal_cores = (steal - self._steal) / _HZ / wall


def wait_quiet(max_wait: float, threshold: float = 0.25) -> float:
    """Wait (up to max_wait s) for a 0.5 s window where other processes use < threshold cores."""
    started = time.perf_counter()
    while time.perf_counter() - started < max_wait:
        with CpuMeter() as m:
            time.sleep(0.5)
        if m.other_cores < threshold:
            break
    return time.perf_counter() - started


@dataclass
class Series:
    """Samples of one metric (higher is better unless ``lower``), with the contention of each."""

    name: str
    unit: str
    lower: bool = False
    values: list[float] = field(default_factory=list)
    other: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def add(self, value: float, meter: CpuMeter | None = None) -> None:
        self.values.append(value)
        if meter is not None:
            self.other.append(meter.other_cores)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def best(self) -> float:
        if not self.values:
            return float("nan")
        return min(self.values) if self.lower else max(self.values)

    def clean(self) -> list[float]:
        """Samples taken while other processes used less than CLEAN_CORES."""
        return [v for v, o in zip(self.values, self.other) if o < CLEAN_CORES]

    def summary(self) -> dict:
        clean = self.clean()
        return {"unit": self.unit, "median": self.median, "best": self.best, "n": len(self.values),
                "n_clean": len(clean), "clean_median": statistics.median(clean) if clean else float("nan"),
                "samples": self.values, "other_cores": self.other, **self.extra}


# ----------------------------------------------------------------------------------------------
# memory bandwidth (run in a child process so the 512 MiB array stays out of this RSS)


def bandwidth_probe(reps: int) -> dict:
    n = BW_ARRAY_BYTES // 4
    a = np.empty(n, np.float32)
    a.fill(1.0)  # touch every page
    halves = (a[: n // 2], a[n // 2:])

    def two_threads() -> float:
        out = [0.0, 0.0]

        def work(i: int) -> None:
            out[i] = float(halves[i].sum())

        threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return BW_ARRAY_BYTES / (time.perf_counter() - t) / 1e9

    def one_thread() -> float:
        t = time.perf_counter()
        a.sum()
        return BW_ARRAY_BYTES / (time.perf_counter() - t) / 1e9

    two_threads()  # warm
    res: dict = {"two": [], "one": [], "other": []}
    for _ in range(reps):
        with CpuMeter() as m:
            res["two"].append(two_threads())
        res["other"].append(m.other_cores)
        res["one"].append(one_thread())
    return res


def run_bandwidth_child(reps: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench", "engine-speed", "--bandwidth-probe", str(reps)],
                         cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# helpers around the engine


def text_with_tokens(tokenizer, n: int) -> str:
    """A prefix of PROSE (repeated as needed) that the model's tokenizer encodes to exactly n ids."""
    base = PROSE
    while len(tokenizer.encode(base)) < n + 16:
        base += PROSE
    ids = tokenizer.encode(base)
    for k in [n, *range(n - 1, n - 8, -1), *range(n + 1, n + 8)]:
        text = tokenizer.decode(ids[:k])
        if len(tokenizer.encode(text)) == n:
            return text
    raise RuntimeError(f"could not build a {n}-token prompt")


class Recorder:
    """Listener that timestamps every event of one request on the engine thread."""

    def __init__(self) -> None:
        self.submitted = time.perf_counter()
        self.times: list[float] = []
        self.result = None
        self.error = None
        self.done = threading.Event()

    def __call__(self, event) -> None:
        from backends.types import GenerationResult, TokenEvent

        if isinstance(event, TokenEvent):
            self.times.append(time.perf_counter())
            return
        if isinstance(event, GenerationResult):
            self.result = event
        else:
            self.error = event
        self.done.set()


def submit_all(engine, prompts: list[str], params) -> list[Recorder]:
    recs = []
    for text in prompts:
        rec = Recorder()
        engine.submit(text, params, listener=rec)
        recs.append(rec)
    for rec in recs:
        if not rec.done.wait(600):
            raise RuntimeError("request timed out")
        if rec.error is not None:
            raise RuntimeError(f"request failed: {rec.error!r}")
    return recs


def steady_rate(recs: list[Recorder]) -> tuple[float, int, float]:
    """Aggregate tokens/s between the moment every row has its first token and the first finish."""
    t0 = max(r.times[0] for r in recs)
    t1 = min(r.times[-1] for r in recs)
    tokens = sum(1 for r in recs for t in r.times if t0 < t <= t1)
    return tokens / (t1 - t0), tokens, t1 - t0


# ----------------------------------------------------------------------------------------------
# the benchmark


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.series: dict[str, Series] = {}
        self.info: dict = {}
        self.compile_log: list[tuple[str, float]] = []

    def s(self, key: str, name: str, unit: str, lower: bool = False) -> Series:
        if key not in self.series:
            self.series[key] = Series(name, unit, lower)
        return self.series[key]

    def quiet(self) -> None:
        if self.args.quiet_wait > 0:
            waited = wait_quiet(self.args.quiet_wait)
            self.info["quiet_wait_s"] = self.info.get("quiet_wait_s", 0.0) + waited

    # --- setup ---

    def load(self) -> None:
        t = time.perf_counter()
        import mindspore  # noqa: F401  (import cost measured separately from model load)

        self.info["mindspore_import_s"] = time.perf_counter() - t
        self.info["mindspore"] = mindspore.__version__
        from backends.settings import EngineConfig

        model_dir = Path(self.args.model_dir) if self.args.model_dir else harness.default_model_dir()
        cfg = dict(max_seq_len=2048, max_input_tokens=1536, max_batch_size=16, block_size=128, prefill_chunk=64)
        if self.args.kernels:
            cfg["kernels"] = self.args.kernels
        if self.args.num_blocks:
            cfg["num_blocks"] = self.args.num_blocks
        self.info["git"] = commit()
        self.config = EngineConfig(**cfg)
        self.info["config"] = {k: v for k, v in cfg.items()}
        self.info["model_dir"] = str(model_dir)

        handler = _CompileLogHandler(self.compile_log)
        logger = logging.getLogger("mindserve.engine")
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)

        with CpuMeter() as m:
            self.engine = harness.engine(model_dir, warmup=False, progress=False, **cfg)
        self.info["load_s"] = m.wall
        self.info["load_other_cores"] = m.other_cores
        self.info["rss_after_load_mb"] = _rss_mb()
        self.runner = self.engine.runner
        self.info["matmul_path"] = ("AOT kernels (backends/mindspore/kernels: matmul, paged attention, fused "
                                    "norm/rope/SwiGLU)" if self.runner.kernels == "aot"
                                    else "stock MindSpore ops (MatMul, windowed attention)")
        shapes = self.runner.shapes
        self.info["shapes"] = {"batch_buckets": list(shapes.batch_buckets),
                               "window_buckets": list(shapes.window_buckets),
                               "prefill_batch_buckets": list(getattr(shapes, "prefill_batch_buckets", (1,))),
                               "prefill_chunk": shapes.prefill_chunk}
        self.info["cache_blocks"] = self.engine.allocator.num_blocks

        full_plan = self.runner.warmup_plan()
        self.info["full_plan_graphs"] = len(full_plan)
        with CpuMeter() as m:
            if self.args.full_warmup or len(full_plan) <= FULL_WARMUP_MAX_GRAPHS:
                self.runner.warmup(progress=not self.args.no_progress)
                plan = full_plan
            else:
                plan = self._subset_warmup(full_plan)
        self.info["warmup_mode"] = "full" if plan is full_plan else "subset"
        self.info["warmup_s"] = m.wall
        self.info["warmup_other_cores"] = m.other_cores
        self.info["graphs"] = len(plan)
        self.info["compile_per_graph"] = [(k, round(v, 3)) for k, v, _ in self.compile_log]
        self.info["rss_after_each_graph_mb"] = [(k, round(r)) for k, _, r in self.compile_log]
        self.info["rss_after_warmup_mb"] = _rss_mb()
        self._compiled_at_warmup = len(self.compile_log)

        # idle CPU of this process (MindSpore runtime threads must not spin between requests)
        with CpuMeter() as m:
            time.sleep(1.0)
        self.info["idle_own_cores"] = m.own_cores

        self.weight_bytes = sum(int(np.prod(p.shape)) * 4 for p in self.runner.net.get_parameters()
                                if p.name.rsplit(".", 1)[-1] in WEIGHT_SUFFIXES)
        self.info["matmul_weight_bytes"] = self.weight_bytes

        tok = self.engine.tokenizer
        self.prompt_short = text_with_tokens(tok, PROMPT_SHORT)
        self.prompt_long = text_with_tokens(tok, PROMPT_LONG)
        self.ids_short = self.engine.prompt_ids(self.prompt_short, None)
        self.ids_long = self.engine.prompt_ids(self.prompt_long, None)
        assert len(self.ids_short) == PROMPT_SHORT and len(self.ids_long) == PROMPT_LONG
        # Benchmark only: never stop on EOS, so every request yields exactly max_new_tokens.
        self.engine.eos_ids = frozenset()
        self.engine.start()

    def _subset_warmup(self, full_plan: list[tuple]) -> list[tuple]:
        """Compile only the graphs this benchmark uses (all window-256 buckets, the B=1 prefill/decode
        graphs at every window, the prompt-logits head): the full default plan needs too much RSS for a
        shared 24 GB box. Calls the runner exactly as ``ModelRunner.warmup`` does (scratch block only)."""
        from backends.mindspore.runners.step import DecodeRow

        small = min(self.runner.shapes.window_buckets)
        keep = [k for k in full_plan
                if k[0] == "head" or k[-1] == small or (k[0] == "prefill" and k[1] == 1)
                or (k[0] == "decode" and k[1] == 1)]
        bs = self.runner.shapes.block_size
        for key in keep:
            if key[0] == "prefill":
                batch, window = key[1], key[-1]
                self._prefill_call([([0], window - 1, [0] * (window // bs))] * batch)
            elif key[0] == "decode":
                batch, window = key[1], key[2]
                self.runner.decode([DecodeRow(0, window - 1, [0] * (window // bs))] * batch)
            else:
                self.runner.prompt_logits(np.zeros((1, self.engine.spec.hidden_size), np.float32))
            if not self.args.no_progress:
                print(f"compiled {key}: {self.compile_log[-1][1]:.1f} s, RSS {_rss_mb():.0f} MB",
                      file=sys.stderr, flush=True)
        return keep

    def _prefill_call(self, chunks: list[tuple[list[int], int, list[int]]]):
        """runner.prefill for (ids, start, blocks) chunks; returns the logits [n, V]."""
        try:
            from backends.mindspore.runners.step import PrefillChunk
        except ImportError:  # the older one-sequence signature prefill(ids, start, blocks)
            assert len(chunks) == 1
            logits, _ = self.runner.prefill(*chunks[0])
            return logits[None]
        logits, _ = self.runner.prefill([PrefillChunk(list(i), st, b) for i, st, b in chunks])
        return logits

    # --- measurements (one round each) ---

    def engine_single(self) -> None:
        from backends.types import RequestParams

        self.quiet()
        params = RequestParams(max_new_tokens=NEW_TOKENS, do_sample=False)
        with CpuMeter() as m:
            (rec,) = submit_all(self.engine, [self.prompt_short], params)
        n = len(rec.times)
        assert n == NEW_TOKENS, n
        self.s("eng1", "engine decode B=1", "tok/s").add((n - 1) / (rec.times[-1] - rec.times[0]), m)
        self.s("eng1_ttft", "engine TTFT, 32-token prompt", "ms", lower=True).add(
            (rec.times[0] - rec.submitted) * 1e3, m)

    def raw_single(self) -> None:
        from backends.mindspore.runners.step import DecodeRow

        self.quiet()
        alloc = self.engine.allocator
        blocks = alloc.allocate(PROMPT_SHORT + NEW_TOKENS)
        try:
            steps = []
            with CpuMeter() as m:
                logits = self._prefill_call([(self.ids_short, 0, blocks)])
                token, pos = int(np.argmax(logits[0])), PROMPT_SHORT
                for _ in range(NEW_TOKENS - 1):
                    t = time.perf_counter()
                    logits = self.runner.decode([DecodeRow(token, pos, blocks)])
                    steps.append(time.perf_counter() - t)
                    token, pos = int(np.argmax(logits[0])), pos + 1
            self.s("raw1", "runner.decode B=1 (ctx 32-160)", "tok/s").add(len(steps) / sum(steps), m)
            self.s("raw1_med", "runner.decode B=1 median step", "ms", lower=True).add(
                statistics.median(steps) * 1e3, m)
            self.graph_only(blocks)
        finally:
            alloc.release(blocks)

    def graph_only(self, blocks: list[int]) -> None:
        """The bare compiled-graph call (inputs pre-built as Tensors) + the logits copy to host."""
        import mindspore as ms
        from backends.mindspore.runners.step import block_table, token_slots

        bs = self.runner.shapes.block_size
        window = self.runner.shapes.window_for(PROMPT_SHORT + NEW_TOKENS)
        pos = np.array([[PROMPT_SHORT + NEW_TOKENS - 1]], np.int32)
        args = self.runner.graph_inputs(np.array([[7]], np.int32), pos,
                                        token_slots(blocks, pos[0], bs).astype(np.int32),
                                        block_table([blocks], window // bs), np.zeros(1, np.int32))
        tensors = [None if a is None else ms.Tensor(a) for a in args]
        self.runner.net(*tensors)[0].asnumpy()
        steps = []
        with CpuMeter() as m:
            for _ in range(32):
                t = time.perf_counter()
                self.runner.net(*tensors)[0].asnumpy()
                steps.append(time.perf_counter() - t)
        self.s("graph1", "bare graph call B=1 (ctx 32-160)", "tok/s").add(len(steps) / sum(steps), m)
        self.s("graph1_med", "bare graph call B=1 median", "ms", lower=True).add(statistics.median(steps) * 1e3, m)

    def raw_windows(self) -> None:
        """runner.decode B=1 late in long contexts (the stock-op path: the larger attention windows)."""
        from backends.mindspore.runners.step import DecodeRow

        for window in LONG_CONTEXTS:
            if window > self.runner.shapes.max_window:
                continue
            self.quiet()
            blocks = self.engine.allocator.allocate(window)
            try:
                pos, token, steps = window - RAW_WINDOW_STEPS - 1, 7, []
                with CpuMeter() as m:
                    for _ in range(RAW_WINDOW_STEPS):
                        t = time.perf_counter()
                        logits = self.runner.decode([DecodeRow(token, pos, blocks)])
                        steps.append(time.perf_counter() - t)
                        token, pos = int(np.argmax(logits[0])), pos + 1
                self.s(f"raw1_w{window}", f"runner.decode B=1 (context {window})", "tok/s").add(
                    len(steps) / sum(steps), m)
            finally:
                self.engine.allocator.release(blocks)

    def raw_batch(self, batch: int) -> None:
        from backends.mindspore.runners.step import DecodeRow

        self.quiet()
        alloc = self.engine.allocator
        seqs = [alloc.allocate(PROMPT_SHORT + NEW_TOKENS) for _ in range(batch)]
        try:
            tokens = [int(i) for i in self.ids_short[:batch]] + [0] * max(0, batch - PROMPT_SHORT)
            pos = PROMPT_SHORT
            steps = []
            with CpuMeter() as m:
                for _ in range(RAW_BATCH_STEPS):
                    rows = [DecodeRow(tokens[i], pos, seqs[i]) for i in range(batch)]
                    t = time.perf_counter()
                    logits = self.runner.decode(rows)
                    steps.append(time.perf_counter() - t)
                    tokens = [int(x) for x in logits.argmax(-1)]
                    pos += 1
            self.s(f"raw{batch}", f"runner.decode B={batch} (ctx 32-160)", "tok/s").add(
                batch * len(steps) / sum(steps), m)
            self.s(f"raw{batch}_med", f"runner.decode B={batch} median step", "ms", lower=True).add(
                statistics.median(steps) * 1e3, m)
        finally:
            for blocks in seqs:
                alloc.release(blocks)

    def engine_batch(self, batch: int) -> None:
        from backends.types import RequestParams

        self.quiet()
        params = RequestParams(max_new_tokens=NEW_TOKENS, do_sample=False)
        with CpuMeter() as m:
            t = time.perf_counter()
            recs = submit_all(self.engine, [self.prompt_short] * batch, params)
            wall = time.perf_counter() - t
        rate, tokens, span = steady_rate(recs)
        assert all(len(r.times) == NEW_TOKENS for r in recs)
        self.s(f"eng{batch}", f"engine decode B={batch}, steady", "tok/s").add(rate, m)
        self.s(f"eng{batch}_e2e", f"engine B={batch} end-to-end", "tok/s").add(batch * NEW_TOKENS / wall, m)

    def prefill(self) -> None:
        from backends.types import RequestParams

        self.quiet()
        with CpuMeter() as m:
            (rec,) = submit_all(self.engine, [self.prompt_long], RequestParams(max_new_tokens=1, do_sample=False))
        self.s("eng_pf", "engine prefill 500 tok (TTFT)", "tok/s").add(
            PROMPT_LONG / (rec.times[0] - rec.submitted), m)

        self.quiet()
        chunk = self.runner.shapes.prefill_chunk
        blocks = self.engine.allocator.allocate(PROMPT_LONG + 1)
        try:
            with CpuMeter() as m:
                for start in range(0, PROMPT_LONG, chunk):
                    self._prefill_call([(self.ids_long[start:start + chunk], start, blocks)])
            self.s("raw_pf", "runner.prefill 500 tok, chunked", "tok/s").add(PROMPT_LONG / m.wall, m)
        finally:
            self.engine.allocator.release(blocks)

    def bandwidth(self) -> None:
        self.quiet()
        res = run_bandwidth_child(3)
        bw = self.s("bw2", "numpy read, 2 threads", "GB/s")
        for v, o in zip(res["two"], res["other"]):
            bw.values.append(v)
            bw.other.append(o)
        self.s("bw1", "numpy read, 1 thread", "GB/s").values.extend(res["one"])

    def host_overheads(self) -> None:
        """Per-token host work the engine adds on top of runner.decode: sampling and detokenizing."""
        from backends.mindspore.modeldir.tokenizer import IncrementalDetokenizer
        from backends.params import resolve
        from backends.sampling import NextTokenChooser
        from backends.types import RequestParams

        eng = self.engine
        chooser = NextTokenChooser(resolve(RequestParams(do_sample=False), eng.spec.defaults, eng.vocab_size),
                                   eng.vocab_size)
        logits = np.random.default_rng(0).standard_normal(eng.spec.vocab_size).astype(np.float32)
        history = list(self.ids_short) + [5] * 100
        reps = 200
        t = time.perf_counter()
        for _ in range(reps):
            chooser.choose(logits, history)
        self.info["greedy_choose_ms"] = (time.perf_counter() - t) / reps * 1e3
        gen = eng.tokenizer.encode(PROSE)[:reps]
        detok = IncrementalDetokenizer(eng.tokenizer, self.ids_short)
        t = time.perf_counter()
        for tid in gen:
            detok.push(tid)
        self.info["detok_push_ms"] = (time.perf_counter() - t) / len(gen) * 1e3

    # --- profile ---

    def profile(self) -> None:
        """Per-op-type time of decode steps at B=1 and B=16 (MindSpore CPU profiler)."""
        from backends.mindspore.runners.step import DecodeRow
        import mindspore
        from mindspore.profiler import ProfilerActivity

        self.info["profile"] = {}
        for batch in (1, 16):
            alloc = self.engine.allocator
            seqs = [alloc.allocate(PROMPT_SHORT + NEW_TOKENS) for _ in range(batch)]
            out_dir = tempfile.mkdtemp(prefix=f"ms_prof_b{batch}_")
            steps = self.args.profile_steps
            try:
                if self.args.quiet_wait > 0:
                    self.info["quiet_wait_s"] = (self.info.get("quiet_wait_s", 0.0)
                                                 + wait_quiet(4 * self.args.quiet_wait))
                rows = [DecodeRow(7, 100, blocks) for blocks in seqs]
                self.runner.decode(rows)
                self.info["profile"][f"B={batch}"] = {"kernels": self._kernel_breakdown(rows, 4 * steps)}
                handler = mindspore.profiler.tensorboard_trace_handler(out_dir)
                with CpuMeter() as m:
                    with mindspore.profiler.profile(activities=[ProfilerActivity.CPU], on_trace_ready=handler):
                        for _ in range(steps):
                            self.runner.decode(rows)
                self.info["profile"][f"B={batch}"] |= _parse_profile(out_dir, steps) | {
                    "wall_s_incl_profiler": m.wall, "other_cores": m.other_cores}
            except Exception as exc:  # the profile is optional
                self.info["profile"].setdefault(f"B={batch}", {})["error"] = repr(exc)
            finally:
                for blocks in seqs:
                    alloc.release(blocks)
                if self.args.keep_profile:
                    self.info["profile"][f"B={batch}"]["dir"] = out_dir
                else:
                    shutil.rmtree(out_dir, ignore_errors=True)

    def _kernel_breakdown(self, rows, steps: int) -> dict | None:
        """Wall time of ``steps`` unprofiled decode steps, split into the time inside each AOT kernel
        (their own counters) and the rest: MindSpore's launches, its few stock ops (cache writes,
        gathers) and the host side of runner.decode."""
        if self.runner.kernels != "aot":
            return None
        from backends.mindspore.kernels import KERNEL_KINDS, kernel_stats

        for kind in KERNEL_KINDS:
            kernel_stats(reset=True, kind=kind)
        t = time.perf_counter()
        for _ in range(steps):
            self.runner.decode(rows)
        wall = (time.perf_counter() - t) / steps * 1e3
        out = {"wall_ms": wall, "steps": steps, "kinds": {}}
        for kind in KERNEL_KINDS:
            calls, sec = kernel_stats(kind=kind)
            out["kinds"][kind] = {"ms_per_step": sec / steps * 1e3, "calls_per_step": calls / steps}
        out["rest_ms"] = wall - sum(v["ms_per_step"] for v in out["kinds"].values())
        return out

    # --- main ---

    def run(self) -> dict:
        t_start = time.perf_counter()
        with CpuMeter() as whole:
            self.load()
            self.host_overheads()
            for r in range(self.args.rounds):
                t = time.perf_counter()
                self.bandwidth()
                self.engine_single()
                self.raw_single()
                self.raw_batch(4)
                self.raw_batch(16)
                self.raw_windows()
                self.engine_batch(4)
                self.engine_batch(16)
                self.prefill()
                self.info.setdefault("loadavg_1min_per_round", []).append(
                    float(open("/proc/loadavg").read().split()[0]))
                if not self.args.no_progress:
                    print(f"round {r + 1}/{self.args.rounds}: {time.perf_counter() - t:.0f}s, "
                          f"B=1 engine {self.series['eng1'].values[-1]:.1f} / runner "
                          f"{self.series['raw1'].values[-1]:.1f} tok/s, other cores "
                          f"{statistics.median(self.series['eng1'].other[-1:]):.2f}",
                          file=sys.stderr, flush=True)
            if not self.args.no_profile:
                self.profile()
        self.engine.close()
        self.info["compiled_during_measurement"] = [k for k, _, _ in self.compile_log[self._compiled_at_warmup:]]
        self.info["total_s"] = time.perf_counter() - t_start
        self.info["whole_run_other_cores"] = whole.other_cores
        self.info["whole_run_steal_cores"] = whole.steal_cores
        self.info["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.info["final_rss_mb"] = _rss_mb()
        return {"info": self.info, "series": {k: v.summary() for k, v in self.series.items()}}


class _CompileLogHandler(logging.Handler):
    def __init__(self, sink: list) -> None:
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("compiled graph") and len(record.args) == 2:
            key, seconds = record.args
            self.sink.append(("/".join(str(k) for k in key), float(seconds), _rss_mb()))


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _parse_profile(out_dir: str, steps: int) -> dict:
    """Op-type table per step, plus MatMul time split by weight shape (from the framework op list)."""
    type_csv = glob.glob(os.path.join(out_dir, "**", "FRAMEWORK", "cpu_op_type_info_*.csv"), recursive=True)
    if not type_csv:
        return {"error": f"no cpu_op_type_info csv under {out_dir}"}
    import csv

    by_type = {}
    with open(type_csv[0]) as fh:
        for row in csv.DictReader(fh):
            by_type[row["op_type"]] = {"ms_per_step": float(row["total_compute_time"]) / steps,
                                       "calls_per_step": float(row["execution_frequency(per-step)"])}
    fw = os.path.dirname(type_csv[0])
    shapes: dict[str, str] = {}
    for path in glob.glob(os.path.join(fw, "cpu_framework_*.txt")):
        with open(path) as fh:
            for line in fh:
                parts = line.rstrip().split(";")
                inputs = [p.split(":", 1)[1] for p in parts[3:] if ":" in p]
                if len(inputs) >= 2 and parts[0] in MATMUL_OPS:
                    shapes[parts[1]] = f"{parts[0]} " + " x ".join(inputs[:2])
    matmul: dict[str, dict] = {}
    for path in glob.glob(os.path.join(fw, "cpu_op_detail_info_*.csv")):
        with open(path) as fh:
            for row in csv.DictReader(fh):
                if row["op_type"] not in MATMUL_OPS:
                    continue
                key = shapes.get(row["op_name"], "?")
                slot = matmul.setdefault(key, {"ms_per_step": 0.0, "ops": 0})
                slot["ms_per_step"] += float(row["op_total_time(ms)"]) / steps
                slot["ops"] += 1
    return {"by_type": by_type, "matmul_by_shape": matmul,
            "op_ms_per_step": sum(v["ms_per_step"] for v in by_type.values())}


# ----------------------------------------------------------------------------------------------
# report


def _fmt(v: float, unit: str) -> str:
    if v != v:
        return "-"
    return f"{v:.1f}" if unit in ("tok/s", "ms", "GB/s") and v < 1000 else f"{v:.0f}"


def report(res: dict, rounds: int) -> str:
    info, S = res["info"], res["series"]
    lines = []
    add = lines.append
    add(f"mindserve engine speed -- {Path(info['model_dir']).name}, fp32, MindSpore {info['mindspore']}, "
        f"{os.cpu_count()} CPUs, python {platform.python_version()}")
    add(f"config: {info['config']}  buckets: batch {info['shapes']['batch_buckets']}, "
        f"window {info['shapes']['window_buckets']}, chunk {info['shapes']['prefill_chunk']}, "
        f"{info['cache_blocks']} cache blocks")
    add(f"code: git {info['git']} (at start); matmul: {info.get('matmul_path', '?')}; graphs compiled during the "
        f"measurements (should be none): {info['compiled_during_measurement'] or 'none'}")
    add(f"rounds: {rounds} (interleaved); median and best over rounds; 'other' = median cores used by other "
        f"processes during the measurement; 'clean' = samples with other < {CLEAN_CORES} cores, and their median")
    add("")
    add("setup")
    add(f"  import mindspore            {info['mindspore_import_s']:.2f} s")
    add(f"  model load (Engine init)    {info['load_s']:.2f} s   (other {info['load_other_cores']:.2f} cores)")
    per = [s for _, s in info["compile_per_graph"]]
    add(f"  warm-up compile ({info['warmup_mode']})    {info['warmup_s']:.1f} s for {info['graphs']} of the "
        f"{info['full_plan_graphs']} default graphs = {info['warmup_s'] / info['graphs']:.2f} s/graph   "
        f"(other {info['warmup_other_cores']:.2f} cores)")
    if per:
        kinds: dict[str, list[float]] = {}
        for key, sec in info["compile_per_graph"]:
            kinds.setdefault(key.split("/")[0], []).append(sec)
        add("  per graph (first call incl. compile): " + ", ".join(
            f"{k} n={len(v)} median {statistics.median(v):.2f} s (min {min(v):.2f}, max {max(v):.2f})"
            for k, v in kinds.items()))
        add("  each: " + ", ".join(f"{k} {s:.1f}" for k, s in info["compile_per_graph"]))
        if info["graphs"] < info["full_plan_graphs"]:
            add(f"  full default plan, extrapolated: {info['full_plan_graphs']} x {statistics.median(per):.2f} s = "
                f"{info['full_plan_graphs'] * statistics.median(per):.0f} s (a lower bound: bigger windows "
                f"and batches compile slower)")
    add(f"  RSS after load / warm-up    {info['rss_after_load_mb']:.0f} / {info['rss_after_warmup_mb']:.0f} MB")
    steps, prev = [], info["rss_after_load_mb"]
    for key, rss in info["rss_after_each_graph_mb"]:
        steps.append(f"{key} +{rss - prev:.0f}")
        prev = rss
    if steps:
        add("  RSS growth per compiled graph (MB): " + ", ".join(steps))
    add(f"  idle CPU of this process    {info['idle_own_cores']:.2f} cores")
    add("")
    add(f"{'measurement':44s} {'median':>9s} {'best':>9s} {'unit':6s} {'n':>3s} {'other':>6s} "
        f"{'clean':>5s} {'median':>7s}")
    order = ["bw2", "bw1", "eng1", "raw1", "graph1", "raw1_med", "graph1_med", "eng1_ttft",
             *sorted((k for k in S if k.startswith("raw1_w")), key=lambda k: int(k[6:])),
             "raw4", "eng4", "eng4_e2e", "raw16", "eng16", "eng16_e2e", "raw4_med", "raw16_med",
             "eng_pf", "raw_pf"]
    names = {**{k: f"  runner.decode B=1, context {k[6:]}" for k in S if k.startswith("raw1_w")},
             "bw2": "numpy read bandwidth, 2 threads", "bw1": "numpy read bandwidth, 1 thread",
             "eng1": "decode B=1 engine (first->last token)", "raw1": "decode B=1 runner.decode (ctx 32-160)",
             "graph1": "decode B=1 bare graph call (ctx 32-160)", "raw1_med": "  runner.decode B=1 median step",
             "graph1_med": "  bare graph call B=1 median", "eng1_ttft": "  engine TTFT, 32-token prompt",
             "raw4": "decode B=4 runner.decode, total", "eng4": "decode B=4 engine, steady total",
             "eng4_e2e": "  B=4 engine end-to-end incl. prefill", "raw16": "decode B=16 runner.decode, total",
             "eng16": "decode B=16 engine, steady total", "eng16_e2e": "  B=16 engine end-to-end incl. prefill",
             "raw4_med": "  runner.decode B=4 median step", "raw16_med": "  runner.decode B=16 median step",
             "eng_pf": "prefill 500 tok, engine (500/TTFT)", "raw_pf": "prefill 500 tok, runner chunks of 64"}
    for key in order:
        if key not in S:
            continue
        s = S[key]
        other = f"{statistics.median(s['other_cores']):.2f}" if s["other_cores"] else "-"
        n_clean = s.get("n_clean", 0) if s["other_cores"] else None
        clean = "-" if n_clean is None else f"{n_clean:d}"
        clean_med = _fmt(s.get("clean_median", float("nan")), s["unit"]) if n_clean else "-"
        add(f"{names[key]:44s} {_fmt(s['median'], s['unit']):>9s} {_fmt(s['best'], s['unit']):>9s} "
            f"{s['unit']:6s} {s['n']:>3d} {other:>6s} {clean:>5s} {clean_med:>7s}")
    add("")
    wb = info["matmul_weight_bytes"]

    def pick(key: str) -> tuple[float, str]:
        """The clean median if any sample was clean, else the median of all rounds."""
        s = S[key]
        if s.get("n_clean"):
            return s["clean_median"], f"clean median of {s['n_clean']}"
        return s["median"], f"median of {s['n']}, none clean"

    bw, bw_how = pick("bw2")
    ceil = bw * 1e9 / wb
    add(f"fp32 ceiling: {wb / 1e6:.1f} MB matmul weights / {bw:.1f} GB/s ({bw_how}) = {ceil:.1f} tok/s "
        f"[all-round median {S['bw2']['median']:.1f} GB/s -> {S['bw2']['median'] * 1e9 / wb:.1f} tok/s]")
    (e1, e1_how), (r1, r1_how), (g1, g1_how) = pick("eng1"), pick("raw1"), pick("graph1")
    add(f"  decode B=1 as % of that ceiling: engine {e1:.1f} tok/s = {100 * e1 / ceil:.0f}% ({e1_how}), "
        f"runner {r1:.1f} = {100 * r1 / ceil:.0f}% ({r1_how}), bare graph {g1:.1f} = {100 * g1 / ceil:.0f}% ({g1_how})")
    add("  the ratios below use the same values (clean medians where there are any)")
    add(f"  effective weight streaming at B=1: engine {wb * e1 / 1e9:.1f} GB/s, bare graph {wb * g1 / 1e9:.1f} GB/s")
    add("ratios")
    add(f"  engine overhead per token: {1e3 / e1 - 1e3 / r1:.2f} ms (engine {1e3 / e1:.1f} vs runner "
        f"{1e3 / r1:.1f} ms/token); runner host prep: {1e3 / r1 - 1e3 / g1:.2f} ms "
        f"(bare graph {1e3 / g1:.1f} ms)")
    add(f"  host work measured alone: greedy choose {info['greedy_choose_ms']:.2f} ms, "
        f"detokenizer push {info['detok_push_ms']:.3f} ms per token")
    for b in (4, 16):
        rb, eb = pick(f"raw{b}")[0], pick(f"eng{b}")[0]
        add(f"  B={b}: runner {rb:.1f} tok/s = {rb / r1:.1f}x B=1 runner, engine steady {eb:.1f} = {eb / e1:.1f}x "
            f"B=1 engine; engine/runner {eb / rb:.2f}")
    add(f"  vs anchors (single stream): engine {e1:.1f} tok/s = {100 * e1 / 56.7:.0f}% of llama.cpp f32 56.7, "
        f"{e1 / 17.6:.2f}x HF fp32 17.6; prototype 17-20")
    add(f"  prefill: engine {pick('eng_pf')[0]:.0f}, runner {pick('raw_pf')[0]:.0f} tok/s "
        f"(prototype chunk-64: ~290 median / 1.72 s best; HF fp32 559, llama.cpp f32 412)")
    prof = info.get("profile")
    if prof:
        add("")
        add("per-op profile of decode steps (MindSpore CPU profiler, ms per step):")
        for b, p in prof.items():
            k = p.get("kernels")
            if k:
                parts = " + ".join(f"{name} {v['ms_per_step']:.2f} ({v['calls_per_step']:.0f} calls)"
                                   for name, v in k["kinds"].items())
                add(f"  {b}: unprofiled step {k['wall_ms']:.2f} ms ({k['steps']} steps) = inside the AOT kernels: "
                    f"{parts} + the rest {k['rest_ms']:.2f} (MindSpore launches and its stock ops, host side)")
            if "error" in p:
                add(f"  {b}: profiler failed: {p['error']}")
                continue
            tot = p["op_ms_per_step"]
            add(f"  {b}: op time {tot:.1f} ms/step "
                f"(profiled wall {1e3 * p['wall_s_incl_profiler'] / info.get('profile_steps', 1):.1f} ms/step "
                f"incl. profiler, other {p['other_cores']:.2f} cores)")
            top = sorted(p["by_type"].items(), key=lambda kv: -kv[1]["ms_per_step"])
            add("    " + ", ".join(f"{k} {v['ms_per_step']:.1f} ({100 * v['ms_per_step'] / tot:.0f}%)"
                                   for k, v in top[:8]))
            if not k:  # MindSpore's MatMul ops, by shape (the AOT kernels all share one op name)
                mm = sorted(p["matmul_by_shape"].items(), key=lambda kv: -kv[1]["ms_per_step"])
                add("    matmuls by shape: " + "; ".join(f"{n}: {v['ms_per_step']:.1f} ms ({v['ops']} ops)"
                                                       for n, v in mm))
    add("")
    add(f"peak RSS {info['peak_rss_mb']:.0f} MB (final {info['final_rss_mb']:.0f} MB); "
        f"total run {info['total_s']:.0f} s; other processes used {info['whole_run_other_cores']:.2f} cores "
        f"on average over the whole run (steal {info['whole_run_steal_cores']:.2f}); "
        f"waited {info.get('quiet_wait_s', 0):.0f} s for quiet windows; "
        f"1-min loadavg after each round {info.get('loadavg_1min_per_round')}")
    return "\n".join(lines)


def charts():
    """bench/harness/charts.py (it exits with the install hint without matplotlib)."""
    from bench.harness import charts as module
    return module


def draw_chart(res: dict, path: str | Path) -> Path:
    """The decode-step breakdown of a run (``res`` as ``--json`` writes it)."""

    info = res["info"]
    title = (f"One decode step of {Path(info['model_dir']).name} (fp32, AOT kernels, context ~100), "
             f"{info.get('cpus', os.cpu_count())} CPUs; git {info['git']}")
    return charts().decode_breakdown_chart(info.get("profile") or {}, Path(path), title)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds (default 5)")
    ap.add_argument("--model-dir", help="model directory (default: the converted SmolLM2-135M)")
    ap.add_argument("--full-warmup", action="store_true",
                    help="compile the engine's whole default plan (runner.warmup(); needs >12 GB RSS) "
                         "instead of only the graphs this benchmark uses")
    ap.add_argument("--kernels", choices=("auto", "aot", "stock"),
                    help="EngineConfig.kernels (default: the engine's default)")
    ap.add_argument("--num-blocks", type=int,
                    help="KV-cache blocks (EngineConfig.num_blocks; default max_batch_size x max_seq_len / block "
                         "+ 1 = 257). 33 is the least the measurements here need")
    ap.add_argument("--no-profile", action="store_true", help="skip the MindSpore profiler pass")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--keep-profile", action="store_true", help="keep the profiler output directories")
    ap.add_argument("--quiet-wait", type=float, default=15.0,
                    help="before each measurement wait up to this many seconds for other load < 0.25 cores")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--bandwidth-probe", type=int, metavar="REPS", help=argparse.SUPPRESS)
    ap.add_argument("--report-from", metavar="JSON", help="print the report of an earlier --json file and exit")
    ap.add_argument("--chart", help="also draw the decode-step breakdown into this PNG (needs matplotlib)")
    ap.add_argument("--chart-from", metavar="JSON",
                    help="draw the chart of an earlier --json file (into --chart, default JSON with .png) and exit")
    harness.add_output_arguments(ap)
    args = ap.parse_args(argv)
    if args.chart or args.chart_from:
        charts()  # before a long run, not after it
    if args.chart_from:
        print(draw_chart(harness.results_of(json.loads(Path(args.chart_from).read_text())),
                         args.chart or Path(args.chart_from).with_suffix(".png")))
        return
    if args.report_from:
        res = harness.results_of(json.loads(Path(args.report_from).read_text()))
        print(report(res, res["info"]["rounds"]))
        return
    if args.bandwidth_probe:
        print(json.dumps(bandwidth_probe(args.bandwidth_probe)))
        return
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    res = Bench(args).run()
    res["info"]["profile_steps"] = args.profile_steps
    res["info"]["rounds"] = args.rounds
    res["info"]["cpus"] = os.cpu_count()
    harness.save_results(args, "engine-speed", res)
    print(report(res, args.rounds))
    if args.chart:
        print(f"chart: {draw_chart(res, args.chart)}")


if __name__ == "__main__":
    main()
