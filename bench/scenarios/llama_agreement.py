"""Greedy token ids of mindserve against llama.cpp's own ``llama-server`` on the same GGUF (issue 14 item 2).

    .venv/bin/python -m bench llama-agreement [--dtypes fp32,q8_0,as-shipped] [--tokens 32] [--json OUT.json] [--save]

For each prompt of ``python -m bench serve``'s set (tokenized once, by mindserve's tokenizer, and sent to both as
token ids, so both start from the very same ids), both generate ``--tokens`` greedy tokens with EOS banned:
llama-server (``-np 1``, 2 threads, ``POST /completion`` with ``temperature 0``, ``top_k 1``, ``ignore_eos``,
``n_probs 2``) and mindserve in process (the AOT runner on the default GGUF converted with each
``convert-gguf --dtype``, argmax of its logits, EOS never special; its KV cache in ``--kv-dtype``, float32 unless
asked). It prints, per weight format, how many prompts agree on every token, the mean common prefix, and at
every first divergence both sides' margins
(mindserve: top-1 minus top-2 logit; llama.cpp: its top-2 probabilities), which tells a near tie (either
side) from a real disagreement. ``--control DIR`` also runs another llama.cpp build's llama-server (e.g. the
AVX2-only one) and prints how often llama.cpp agrees with itself: the noise floor of this count (see
docs/performance.md, "Agreement with llama-server"). Never run by the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from bench import harness
from bench.harness.paths import CACHE_DIR, LLAMA_ANCHORS
from bench.harness.server import free_port
from bench.serving.scenarios import PROMPTS
from bench.serving.servers import THREADS


def start_llama_server(bindir: Path, gguf: Path, port: int, log_path: Path,
                       extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(bindir), env.get("LD_LIBRARY_PATH")]))
    cmd = [str(bindir / "llama-server"), "-m", str(gguf), "-t", str(THREADS), "-tb", str(THREADS), "-c", "4096",
           "-np", "1", "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode}); see {log_path}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama-server not ready after 120 s; see {log_path}")


def llama_run(bindir: Path, gguf: Path, prompts: list[list[int]], n: int, log_path: Path,
              extra: tuple[str, ...], probs: int = 2) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """llama_greedy of every prompt on a llama-server of the build in ``bindir``, started for them and stopped."""
    port = free_port()
    server = start_llama_server(bindir, gguf, port, log_path, extra)
    try:
        return [llama_greedy(port, ids, n, probs) for ids in prompts]
    finally:
        server.terminate()
        server.wait(30)


def llama_greedy(port: int, ids: list[int], n: int,
                 probs: int = 2) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """(generated ids, per step the top-``probs`` (id, prob) llama.cpp reports)."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "n_probs": probs,
            "post_sampling_probs": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    tops = []
    for step in out.get("completion_probabilities", []):
        cands = step.get("top_logprobs") or step.get("top_probs") or step.get("probs") or []
        tops.append([(int(c["id"]), float(np.exp(c["logprob"])) if "logprob" in c else float(c.get("prob", np.nan)))
                     for c in cands[:probs] if "id" in c])
    return [int(t) for t in out["tokens"]], tops


def mindserve_prefill(runner, ids: list[int], blocks: list[int]) -> np.ndarray:
    """The logits after the prompt ``ids`` (prefilled in the runner's chunks into cache blocks ``blocks``)."""
    from backends.mindspore.runners.step import PrefillChunk

    chunk = runner.shapes.prefill_chunk
    for start in range(0, len(ids), chunk):
        logits, _ = runner.prefill([PrefillChunk(ids[start:start + chunk], start, blocks)])
    return logits[0]


def first_token_gaps(runner, prompts: list[list[int]], theirs) -> np.ndarray:
    """Per prompt and per token of llama.cpp's top list after the prompt: mindserve's log-probability minus
    llama.cpp's (float64 log-softmax of mindserve's logits)."""
    gaps = []
    for ids, (_, tops) in zip(prompts, theirs):
        logits = mindserve_prefill(runner, ids, list(range(1, 1 + (len(ids) + 63) // 64))).astype(np.float64)
        lp = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
        gaps.append([lp[t] - np.log(p) for t, p in tops[0]])
    return np.array(gaps)


def mindserve_greedy(runner, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """(generated ids, per step the top-1 minus top-2 logit)."""
    from backends.mindspore.runners.step import DecodeRow

    blocks = list(range(1, 1 + (len(ids) + n + 63) // 64))
    logits = mindserve_prefill(runner, ids, blocks)
    seq, out, margins = list(ids), [], []
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        token = int(np.argmax(logits))
        out.append(token)
        seq.append(token)
        logits = runner.decode([DecodeRow(token, len(seq) - 1, blocks)])[0]
    return out, margins


def make_runner(model_dir: Path, kv_dtype: str = "float32"):
    return harness.runner(model_dir, num_blocks=8, kernels="aot", threads=THREADS, kv_dtype=kv_dtype,
                          block_size=64, prefill_chunk=32, batch_buckets=(1,), window_buckets=(256,))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="fp32,q8_0,as-shipped", help="convert-gguf --dtype values to compare")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--cuts", default="1",
                    help="fractions of each prompt's tokens to start from, e.g. '1,0.6': every prompt whole and cut "
                         "to its first 60%% (twice the prompts; each cut is its own context)")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: the default model's Q4_1)")
    ap.add_argument("--kv-dtype", default="float32",
                    help="mindserve's KV cache format (kvCacheDtype: float32, float16, ...; llama-server keeps f16)")
    ap.add_argument("--llama-server-dir", type=Path, default=LLAMA_ANCHORS)
    ap.add_argument("--llama-args", default="",
                    help="extra llama-server arguments, e.g. '-fa off -ctk f32 -ctv f32' (its exact attention: no "
                         "float16 K/V or flash-attention accumulation); default: its own defaults")
    ap.add_argument("--first-token", action="store_true",
                    help="instead of greedy ids: after each prompt, mindserve's log-probabilities against "
                         "llama-server's at its top 10 tokens (with an F32 GGUF and --llama-args '-fa off -ctk f32 "
                         "-ctv f32': how exact the architecture is)")
    ap.add_argument("--control", type=Path, default=None,
                    help="another llama.cpp build's directory (e.g. the AVX2-only one): its llama-server is run on "
                         "the same prompts and its agreement with the first printed as the noise floor")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "mindserve-bench")
    harness.add_output_arguments(ap)
    args = ap.parse_args(argv)

    from backends.mindspore.sources.default_model import MODEL_NAME, ensure_default_gguf
    from backends.mindspore.sources.gguf_convert import convert_gguf
    from backends.mindspore.modeldir.tokenizer import Tokenizer

    gguf = args.gguf or ensure_default_gguf(CACHE_DIR)
    args.workdir.mkdir(parents=True, exist_ok=True)
    dirs = {d: convert_gguf(gguf, args.workdir / "models" / d, model_name=MODEL_NAME, progress=False, dtype=d)
            for d in args.dtypes.split(",")}
    tok = Tokenizer.from_model_dir(next(iter(dirs.values())))
    whole = [tok.encode(p) for p in PROMPTS[:args.prompts]]
    prompts = [ids[:max(1, round(len(ids) * float(cut)))] for cut in args.cuts.split(",") for ids in whole]

    extra = tuple(args.llama_args.split())
    if args.first_token:
        theirs = llama_run(args.llama_server_dir, gguf, prompts, 1, args.workdir / "llama-agreement-server.log",
                           extra, probs=10)
        print(f"First-token log-probabilities, mindserve - llama-server at llama.cpp's top 10, {gguf.name}, "
              f"{len(prompts)} prompts, mindserve's KV cache {args.kv_dtype}, llama-server "
              f"{args.llama_args or 'with its defaults'}")
        for dtype, path in dirs.items():
            runner = make_runner(path, args.kv_dtype)
            gaps = first_token_gaps(runner, prompts, theirs)
            print(f"  {dtype}: mean |difference| {np.abs(gaps).mean():.4f}, max {np.abs(gaps).max():.4f}, "
                  f"mean {gaps.mean():+.4f}")
            del runner
        return 0
    theirs = llama_run(args.llama_server_dir, gguf, prompts, args.tokens, args.workdir / "llama-agreement-server.log",
                       extra)

    record = {"gguf": gguf.name, "tokens": args.tokens, "prompts": len(prompts), "kv_dtype": args.kv_dtype,
              "llama_args": args.llama_args, "formats": {}}
    print(f"Greedy ids, mindserve vs llama-server on {gguf.name}: {len(prompts)} prompts x {args.tokens} tokens, "
          f"EOS banned, the same prompt ids on both sides, mindserve's KV cache {args.kv_dtype}, "
          f"llama-server {args.llama_args or 'with its defaults'}")
    if args.control:
        # The noise floor: llama.cpp against itself, another build of the same source on the same file and machine.
        # Its kernels differ only in float order (vector width), which a quantized model's activation rounding
        # amplifies as it would mindserve's.
        other = llama_run(args.control, gguf, prompts, args.tokens, args.workdir / "llama-agreement-control.log",
                          extra)
        same = sum(a[0] == b[0] for a, b in zip(theirs, other))
        before = sum(common_prefix(a[0], b[0]) for a, b in zip(theirs, other))
        print(f"\ncontrol: llama-server ({args.control}) vs llama-server ({args.llama_server_dir}): "
              f"{same}/{len(prompts)} prompts identical over all {args.tokens} tokens; "
              f"{before}/{len(prompts) * args.tokens} tokens before the first divergence")
        record["control"] = {"build": str(args.control), "identical": same, "tokens_before_divergence": before}
    for dtype, path in dirs.items():
        runner = make_runner(path, args.kv_dtype)
        rows = []
        for i, ids in enumerate(prompts):
            mine, margins = mindserve_greedy(runner, ids, args.tokens)
            ref, tops = theirs[i]
            k = common_prefix(mine, ref)
            row = {"prompt": i, "prompt_tokens": len(ids), "common_prefix": k, "identical": k == args.tokens}
            if k < args.tokens:
                row |= {"mindserve_margin": margins[k], "mindserve_token": mine[k], "llama_token": ref[k],
                        "llama_top2": tops[k] if k < len(tops) else None}
            rows.append(row)
        same = sum(r["identical"] for r in rows)
        mean_prefix = float(np.mean([r["common_prefix"] for r in rows]))
        print(f"\n{dtype} ({runner.spec.weight_dtype} layers): {same}/{len(rows)} prompts identical over all "
              f"{args.tokens} tokens; mean common prefix {mean_prefix:.1f} tokens; "
              f"{sum(r['common_prefix'] for r in rows)}/{len(rows) * args.tokens} tokens before the first divergence")
        for r in rows:
            if r["identical"]:
                continue
            top2 = r["llama_top2"]
            gap = (f"llama.cpp top-2 p {top2[0][1]:.3f} vs {top2[1][1]:.3f}" if top2 and len(top2) == 2
                   else "llama.cpp top-2 not reported")
            print(f"  prompt {r['prompt']:>2} ({r['prompt_tokens']} tokens): diverges at token {r['common_prefix']}: "
                  f"mindserve {r['mindserve_token']} (top-1 - top-2 logit {r['mindserve_margin']:.3f}), "
                  f"llama.cpp {r['llama_token']} ({gap})")
        split = [r for r in rows if not r["identical"] and r["llama_top2"] and len(r["llama_top2"]) == 2]
        second = sum(r["llama_top2"][1][0] == r["mindserve_token"] for r in split)
        gaps = [float(np.log(r["llama_top2"][0][1] / r["llama_top2"][1][1])) for r in split]
        if split:
            print(f"  where they part, mindserve's token is llama.cpp's second choice in {second} of {len(split)}; "
                  f"llama.cpp's own top-1/top-2 log-probability gap there is at most {max(gaps):.3f}, mindserve's "
                  f"top-1/top-2 logit gap at most {max(r['mindserve_margin'] for r in split):.3f}")
        record["formats"][dtype] = {"identical": same, "mean_common_prefix": mean_prefix, "second_choice": second,
                                    "max_llama_gap": max(gaps, default=None), "rows": rows}
        del runner
    harness.save_results(args, "llama-agreement", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
