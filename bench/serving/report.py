"""The report of a run: a table per scenario, the ratios to llama.cpp, the issues' bars, the servers, the JSON
record and the chart."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .scenarios import (CONCURRENCY_SWEEP, LONG_NEW_TOKENS, LONG_PROMPT_TOKENS, SYSTEM_PROMPT_TOKENS, PromptSets,
                        Scenario)
from .servers import LLAMA_SERVER_CTX, LLAMA_SERVER_SLOTS, THREADS, LlamaCppServer, LlamaServer, MindServe, Server


@dataclass
class Run:
    """One run: what was measured against what, and the results (filled in as the servers are driven)."""

    servers: list[Server]
    scenarios: list[Scenario]
    prompts: PromptSets
    max_new: int
    bandwidth: dict
    load0: tuple[float, float, float]
    started: str
    results: dict[str, dict[str, dict]]  # scenario name → server name → run_scenario's figures
    info: dict[str, dict]  # server name → ready time, greedy check, peak RSS, or its error
    machine: dict  # bench.harness.machine_facts()


def fmt(x: float, spec: str) -> str:
    """``x`` formatted, or "-" for None or nan."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(scenario: Scenario, rows: list[dict], prompt_desc: str, max_new: int) -> None:
    """One scenario's table: a row per server."""
    print()
    print(f"== {scenario.name}: {scenario.concurrency} concurrent client(s), {scenario.requests} requests, "
          f"{prompt_desc}, max_new_tokens {max_new}, greedy")
    head = (f"{'server':<26} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8} "
            f"{'ok/fail':>8} {'tok/req':>7} {'wall s':>7} {'max gen':>7} {'RSS MiB':>8} {'srv cpu':>7} {'others':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['server']:<26} {fmt(r['tok_per_s'], '7.1f')} {fmt(r['ttft_p50_ms'], '7.0f')}ms "
              f"{fmt(r['ttft_p95_ms'], '7.0f')}ms {fmt(r['itl_p50_ms'], '6.1f')}ms {fmt(r['itl_p95_ms'], '6.1f')}ms "
              f"{r['completed']:>4}/{r['failed']:<3} {fmt(r['tokens_per_request'], '7.1f')} {fmt(r['wall_s'], '7.1f')} "
              f"{r['max_streams_generating']:>7} {fmt(r['peak_rss_mib'], '8.0f')} {fmt(r['server_cores'], '7.2f')} "
              f"{fmt(r['other_cores'], '6.2f')}")
        if r["stopped_early"]:
            print(f"    {r['stopped_early']} request(s) ended on EOS before max_new_tokens")
        for e in r["errors"]:
            print(f"    error: {e}")


def ratio(a: float, b: float) -> float:
    """a ÷ b, nan if either is nan or b is 0."""
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def charts():
    """bench/harness/charts.py (it exits with the install hint without matplotlib)."""
    from bench.harness import charts as module
    return module


def draw_chart(record: dict, path: Path) -> Path:
    """The chart of a run (``record`` as ``--json`` writes it): throughput and TTFT by concurrency."""

    about = [f"serve_bench {record['date']}" if "date" in record else "serve_bench",
             f"{record['max_new_tokens']} new tokens per request, greedy, streamed"]
    if "cpus" in record:
        about.append(f"{record['cpus']} CPUs, every server on {record.get('threads', THREADS)} threads")
    return charts().serve_chart(record, path, CONCURRENCY_SWEEP, "; ".join(about))


def mindserve_names(servers: list[Server]) -> tuple[list[str], str]:
    """The mindserve targets the ratios and bars compare (not -nocache, not -lora), and the one the issue 4 bars
    name."""
    ms_names = [s.name for s in servers
                if isinstance(s, MindServe) and s.name not in ("mindserve-nocache", "mindserve-lora")]
    return ms_names, "mindserve" if "mindserve" in ms_names else (ms_names[0] if ms_names else "mindserve")


def bandwidth_note(bandwidth: dict) -> str:
    return (f"memory bandwidth (numpy, 1 thread): copy {bandwidth['copy_gbs']:.1f} GB/s, "
            f"read {bandwidth['read_gbs']:.1f} GB/s")


def print_tables(run: Run) -> None:
    """The heading of the report and a table per scenario."""
    print()
    print("=" * 100)
    print(f"Served benchmark, {time.strftime('%Y-%m-%d %H:%M:%S')}; {os.cpu_count()} CPUs, every server on "
          f"{THREADS} threads; load average at start {run.load0[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    print("tok/s = generated tokens received ÷ scenario wall time; TTFT = request sent → first token received; "
          "ITL = gap between consecutive tokens of one stream;")
    print("max gen = most streams generating tokens at the same moment; RSS = server peak RSS during the "
          "scenario; srv cpu = cores the server used; others = cores used by other processes meanwhile.")
    for sc in run.scenarios:
        rows = [run.results[sc.name][s.name] for s in run.servers if s.name in run.results[sc.name]]
        print_table(sc, rows, run.prompts.desc[sc.fixed_prompt_tokens], sc.max_new or run.max_new)


def print_ratios(run: Run, ms_names: list[str]) -> None:
    """Throughput and TTFT p50 of each mindserve target ÷ each llama.cpp server's, per scenario."""
    print()
    print("Ratios mindserve ÷ llama.cpp (throughput: higher is better for mindserve; TTFT p50: lower is better); "
          f"{bandwidth_note(run.bandwidth)}")
    for sc in run.scenarios:
        r = run.results[sc.name]
        for name in ms_names:
            if name not in r:
                continue
            parts = []
            for label in ("llama-server", "llama-server+ngram", "llama.cpp Q4_1", "llama.cpp F32"):
                if label in r:
                    tput = fmt(ratio(r[name]['tok_per_s'], r[label]['tok_per_s']), '.2f')
                    ttft = fmt(ratio(r[name]['ttft_p50_ms'], r[label]['ttft_p50_ms']), '.2f')
                    parts.append(f"÷ {label}: throughput {tput}×, TTFT p50 {ttft}×")
            print(f"  {sc.name:<9} {name:<20} " + ";  ".join(parts))


def print_llama_server_bars(run: Run, ms_names: list[str], ms_name: str) -> None:
    """Issue 14's bars: mindserve ÷ llama-server at 1 and 16 clients, and prefix-cache TTFT."""
    results, llama = run.results, "llama-server"
    print()
    print(f"Bars (issue 14: mindserve ÷ llama-server, same Q4_1 GGUF, {THREADS} threads each; "
          f"{bandwidth_note(run.bandwidth)})")
    for name in ms_names:
        if "c1" in results and name in results["c1"] and llama in results["c1"]:
            x = ratio(results["c1"][name]["tok_per_s"], results["c1"][llama]["tok_per_s"])
            print(f"  {name}: single stream (c1) ≥ 1.0× llama-server (goal 1.2×): "
                  f"{results['c1'][name]['tok_per_s']:.1f}"
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


def print_lora_bars(run: Run) -> None:
    """Issue 11's bars, if mindserve-lora ran a LoRA scenario: adapters ÷ base only, at 16 clients and at 1."""
    results, lora_name = run.results, "mindserve-lora"
    if not any(lora_name in results.get(n, {}) for n in ("c1-lora", "c16-lora")):
        return
    print()
    print(f"Bars (issue 11: LoRA on {lora_name}, 4 adapters of rank 8 on all seven projections; "
          f"{bandwidth_note(run.bandwidth)})")
    for mixed, plain, bar, what in (("c16-lora", "c16", 0.8, "16 clients over 4 adapters + base vs base only"),
                                    ("c1-lora", "c1", 0.85, "single stream with an adapter vs base")):
        a, b = results.get(mixed, {}).get(lora_name), results.get(plain, {}).get(lora_name)
        if a and b:
            x = ratio(a["tok_per_s"], b["tok_per_s"])
            print(f"  {what}: {a['tok_per_s']:.1f} ÷ {b['tok_per_s']:.1f} tok/s = {x:.2f}× (bar ≥ {bar}) → "
                  f"{'PASS' if x >= bar else 'FAIL'}")


def print_speculation_bars(run: Run, ms_names: list[str]) -> None:
    """Issue 25's bars, for each mindserve target that ran with and without +spec: the quote-heavy workload's
    speed-up and its place against llama-server's n-gram mode, the no-overlap loads' cost, equal greedy texts."""
    results, theirs = run.results, "llama-server+ngram"
    pairs = [(name, name + "+spec") for name in ms_names if name + "+spec" in ms_names]
    if not pairs:
        return
    print()
    print(f"Bars (issue 25: prompt-lookup speculation on ÷ off, same server and weights; "
          f"{bandwidth_note(run.bandwidth)})")
    for off, on in pairs:
        for sc, bar, what in (("c1-quote", 1.8, "quote-heavy single stream"), ("c1-code", 1.8, "code edit, 1 client"),
                              ("c1", 0.95, "no overlap, 1 client"),
                              ("c16", 0.95, "no overlap, 16 clients")):
            r = results.get(sc, {})
            if on in r and off in r:
                x = ratio(r[on]["tok_per_s"], r[off]["tok_per_s"])
                same = sum(a == b for a, b in zip(r[on]["texts"], r[off]["texts"]) if a is not None and b is not None)
                print(f"  {on}: {what} ({sc}) ≥ {bar}× off: {r[on]['tok_per_s']:.1f} ÷ {r[off]['tok_per_s']:.1f} "
                      f"tok/s = {x:.2f}× → {'PASS' if x >= bar else 'FAIL'}; greedy texts equal on/off for {same} of "
                      f"{len(r[on]['texts'])} prompts")
        quote = results.get("c1-quote", {})
        if on in quote and theirs in quote:
            x = ratio(quote[on]["tok_per_s"], quote[theirs]["tok_per_s"])
            plain = (f"; llama-server without it {quote['llama-server']['tok_per_s']:.1f}"
                     if "llama-server" in quote else "")
            print(f"  {on}: quote-heavy single stream ahead of {theirs}: {quote[on]['tok_per_s']:.1f} ÷ "
                  f"{quote[theirs]['tok_per_s']:.1f} tok/s = {x:.2f}× → {'PASS' if x > 1.0 else 'FAIL'}{plain}")


def print_issue4_bars(run: Run, ms_name: str) -> None:
    """Issue 4's bars: throughput against llama-cpp-python, TTFT, single stream, prefix cache, peak RSS."""
    results = run.results
    prefix = results.get("c8-prefix", {})
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


def print_servers(run: Run) -> None:
    """Each server's start-up, peak RSS and greedy check; how the llama.cpp servers batch; the logs."""
    results, info, servers = run.results, run.info, run.servers
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
        most = max((results[sc.name]["llama-server"]["max_streams_generating"] for sc in run.scenarios
                    if "llama-server" in results[sc.name]), default=0)
        print(f"  llama-server batches requests continuously over {LLAMA_SERVER_SLOTS} slots (-np) sharing a "
              f"{LLAMA_SERVER_CTX}-token KV cache; observed at most {most} stream(s) generating at once. Its "
              f"requests ban EOS (ignore_eos) and keep each slot's prompt cache (cache_prompt).")
    if any(isinstance(s, LlamaCppServer) for s in servers):
        most = max((results[sc.name][s.name]["max_streams_generating"] for sc in run.scenarios for s in servers
                    if isinstance(s, LlamaCppServer) and s.name in results[sc.name]), default=0)
        print(f"  llama-cpp-python's server handles one request at a time: every request holds a global lock "
              f"(llama_outer_lock/llama_inner_lock) for its whole generation, no batching across requests; "
              f"observed at most {most} stream(s) generating at once. Its default interrupt_requests=True "
              f"would cancel the running stream whenever another request arrives, so it runs with "
              f"--interrupt_requests False (requests queue instead).")
    for s in servers:
        print(f"  {s.name} log: {s.log_path}")


def print_report(run: Run) -> None:
    """Everything the run measured, as text."""
    ms_names, ms_name = mindserve_names(run.servers)
    print_tables(run)
    print_ratios(run, ms_names)
    print_llama_server_bars(run, ms_names, ms_name)
    print_lora_bars(run)
    print_speculation_bars(run, ms_names)
    print_issue4_bars(run, ms_name)
    print_servers(run)


def run_record(run: Run) -> dict:
    """The run as ``--json`` writes it (and ``--chart-from`` reads it)."""
    return {"date": run.started, "cpus": os.cpu_count(), "threads": THREADS, "max_new_tokens": run.max_new,
            "memory_bandwidth": run.bandwidth,
            "load_avg_start": run.load0, "servers": run.info, "scenarios": run.results,
            "prompts": {"varied": run.prompts.varied, "fixed32": run.prompts.fixed32}}
