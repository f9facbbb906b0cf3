"""The servers under test: how to start each, when it is ready, and one streamed request to it (TTFT, ITL)."""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.harness.server import free_port, serve_command, serve_env

from .meters import RssSampler

THREADS = 2
LLAMA_SERVER_SLOTS, LLAMA_SERVER_CTX = 16, 32768  # -np 16: a slot per client of c16, 2048 tokens each
SPEC_DRAFT = 8  # draft tokens per verify step, both servers (mindserve's decoding_length, llama-server's m)
# llama-server's prompt-lookup mode: the last N tokens looked up in the slot's tokens (prompt and output), the M
# that followed drafted; N 3 (its default 12 rarely matches a short answer's first tokens).
LLAMA_NGRAM = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
               "--spec-ngram-simple-size-m", str(SPEC_DRAFT))


def log(msg: str) -> None:
    """One progress line, time-stamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class RequestResult:
    """What one streamed request gave: its times, tokens, text and outcome."""

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


class Server:
    """A server process on a free port: started, checked for readiness, sent requests, stopped."""

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

    async def step_totals(self, session: aiohttp.ClientSession) -> dict[str, tuple[float, float, float]] | None:
        """The engine's steps so far, by kind: (steps, seconds, tokens); None for a server that does not say."""
        return None

    async def answers_200(self, session: aiohttp.ClientSession, path: str) -> bool:
        """GET ``path`` is 200 now (a 503 while a model loads, no answer at all: not yet)."""
        try:
            async with session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

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
    async def request(self, session: aiohttp.ClientSession, prompt: str, max_new: int,
                      stop_at_eos: bool = False) -> RequestResult:
        """``stop_at_eos`` False: EOS is banned where the server lets a request ban it."""
        raise NotImplementedError

    async def stream(self, session: aiohttp.ClientSession, path: str, body: dict, read, final: str,
                     headers: dict | None = None) -> RequestResult:
        """POST ``body`` to ``path`` and hand each SSE payload to ``read(res, data, now)`` (True: the stream is
        over). A non-200 answer, a transport error, an error ``read`` records or a stream without its ``final``
        event fails the result."""
        res = RequestResult(ok=False, start=time.perf_counter())
        try:
            async with session.post(self.base + path, json=body, headers=headers) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return res
                async for data, now in _sse_lines(resp):
                    if read(res, data, now):
                        break
            if res.error is not None:
                return res
            res.ok = res.finish_reason is not None  # 0 tokens is a valid answer (EOS first)
            if not res.ok:
                res.error = f"stream ended without its {final} ({res.tokens} tokens)"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        res.end = time.perf_counter()
        return res

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
                 adapters: dict[str, Path] | None = None, name: str | None = None, speculation: bool = False,
                 model_ref: str | None = None):
        """``model_ref``: serve it as a user types it (``mindserve serve --config COPY MODEL``: a package name, a GGUF
        file, ..., found in the model cache), ``model_dir`` being its cached directory; None: ``model_dir`` in the
        copy's modelWeightPath."""
        if not prefix_caching:
            self.name = "mindserve-nocache"
        if adapters:
            self.name = "mindserve-lora"
        if name is not None:
            self.name = name
        super().__init__(workdir)
        self.model_dir, self.model_ref = model_dir, model_ref
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
        deploy.setdefault("threads", THREADS)  # as llama-server's -t, whatever the box (a config's own key wins)
        if speculation:  # prompt lookup (docs/speculative.md), the reference server's keys
            deploy["speculationGamma"] = SPEC_DRAFT
            deploy["ModelConfig"][0]["plugin_params"] = json.dumps(
                {"plugin_type": "memory_decoding", "decoding_length": SPEC_DRAFT, "dynamic_algo": True})
        if adapters:
            deploy["LoraModules"] = [{"name": n, "path": str(p), "baseModelName": deploy["ModelConfig"][0]["modelName"]}
                                     for n, p in adapters.items()]
        self.config = cfg
        self.config_path.write_text(f"# generated by bench/serve_bench.py from {config_src}\n"
                                    + yaml.safe_dump(cfg, sort_keys=False))

    async def step_totals(self, session: aiohttp.ClientSession) -> dict[str, tuple[float, float, float]] | None:
        """From /metrics: ``engine_step_duration_seconds`` and ``engine_step_tokens`` (docs/api.md)."""
        from prometheus_client.parser import text_string_to_metric_families

        async with session.get(self.base + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
            text = await r.text()
        totals: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                at = {"engine_step_duration_seconds_count": 0, "engine_step_duration_seconds_sum": 1,
                      "engine_step_tokens_sum": 2}.get(sample.name)
                if at is not None:
                    totals.setdefault(sample.labels["kind"], [0.0, 0.0, 0.0])[at] = sample.value
        return {kind: tuple(t) for kind, t in totals.items()} or None

    def command(self) -> list[str]:
        return serve_command(self.config_path, self.port, *([self.model_ref] if self.model_ref else []))

    def env(self) -> dict:
        return serve_env(extra={"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")})

    async def ready(self, session) -> bool:
        return "listening on" in self.tail(40) and await self.answers_200(session, "/health")

    async def request(self, session, prompt, max_new, stop_at_eos=False, adapter: str | None = None) -> RequestResult:
        # POST / has no way to ban EOS: a continuation prompt rarely meets it; stop_at_eos changes nothing here.
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new, "do_sample": False}, "stream": True}
        if adapter is not None:
            body["parameters"]["adapter_id"] = adapter
        return await self.stream(session, "/", body, _read_tgi_event, "final event")


def _read_tgi_event(res: RequestResult, data: str, now: float) -> bool:
    """One TGI stream event: its token (EOS is not a text token: llama.cpp does not stream it either), and at the
    end the generated text and finish reason."""
    event = json.loads(data)
    if "error" in event:
        res.error = f"stream error: {event}"
        return True
    tok = event.get("token") or {}
    ids = tok.get("id")
    _record_tokens(res, 0 if tok.get("special") else len(ids) if isinstance(ids, list) else 1, now)
    if event.get("generated_text") is not None:
        res.text = event["generated_text"]
        res.finish_reason = (event.get("details") or {}).get("finish_reason") or "done"
    return False


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
        return await self.answers_200(session, "/v1/models")

    async def request(self, session, prompt, max_new, stop_at_eos=False) -> RequestResult:
        # repeat_penalty defaults to 1.1 in llama-cpp-python's server: 1.0 makes temperature 0 plain argmax.
        body = {"prompt": prompt, "max_tokens": max_new, "temperature": 0.0, "repeat_penalty": 1.0,
                "top_k": 1, "stream": True}
        res = await self.stream(session, "/v1/completions", body, _read_openai_chunk, "finish_reason")
        if res.finish_reason == "length" and res.tokens != max_new:
            res.tokens = max_new  # a multi-byte character held back several tokens as one chunk
        return res


def _read_openai_chunk(res: RequestResult, data: str, now: float) -> bool:
    """One OpenAI completions chunk: one per generated token (see README), the last with its finish_reason."""
    if data == "[DONE]":
        return True
    choice = json.loads(data)["choices"][0]
    piece = choice.get("text") or ""
    res.text += piece
    if choice.get("finish_reason") is None:
        _record_tokens(res, 1, now)
    else:
        res.finish_reason = choice["finish_reason"]
        if piece:
            _record_tokens(res, 1, now)
    return False


class LlamaServer(Server):
    """llama.cpp's own HTTP server: continuous batching over ``-np`` slots, a per-slot prompt cache."""

    name = "llama-server"

    def __init__(self, workdir: Path, gguf: Path, bindir: Path, slots: int = LLAMA_SERVER_SLOTS,
                 ctx: int = LLAMA_SERVER_CTX, speculation: bool = False):
        if speculation:
            self.name = "llama-server+ngram"
        super().__init__(workdir)
        self.gguf, self.bindir, self.slots, self.ctx = gguf, bindir, slots, ctx
        self.extra = LLAMA_NGRAM if speculation else ()

    def command(self) -> list[str]:
        # Continuous batching is llama-server's default (-cb); said anyway. -c is the whole KV cache, shared
        # by the -np slots (ctx / slots tokens each).
        return [str(self.bindir / "llama-server"), "-m", str(self.gguf), "-t", str(THREADS), "-tb", str(THREADS),
                "-c", str(self.ctx), "-np", str(self.slots), "--cont-batching",
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra]

    def env(self) -> dict:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.bindir), env.get("LD_LIBRARY_PATH")]))
        return env

    async def ready(self, session) -> bool:
        return await self.answers_200(session, "/health")

    async def request(self, session, prompt, max_new, stop_at_eos=False) -> RequestResult:
        # temperature 0 is greedy; ignore_eos bans EOS (every request generates max_new tokens, as the
        # continuation prompts make mindserve's do); return_tokens puts the chunk's token ids in each event.
        body = {"prompt": prompt, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
                "ignore_eos": not stop_at_eos, "cache_prompt": True, "return_tokens": True, "stream": True}
        # A fresh connection each time: llama-server's HTTP library closes a kept-alive connection after a few
        # requests, and reusing it fails with "Can not write request body".
        return await self.stream(session, "/completion", body, _read_llama_chunk, "stop event",
                                 headers={"Connection": "close"})


def _read_llama_chunk(res: RequestResult, data: str, now: float) -> bool:
    """One llama-server /completion chunk: its content and token ids; the last says stop (its token count wins)."""
    chunk = json.loads(data)
    if "error" in chunk:
        res.error = f"stream error: {chunk['error']}"
        return True
    res.text += chunk.get("content") or ""
    ids = chunk.get("tokens")
    _record_tokens(res, len(ids) if isinstance(ids, list) else int(bool(chunk.get("content"))), now)
    if chunk.get("stop"):
        res.finish_reason = chunk.get("stop_type") or "stop"
        predicted = chunk.get("tokens_predicted")
        if isinstance(predicted, int) and predicted != res.tokens:
            res.tokens = predicted  # the server's own count wins
        return True
    return False
