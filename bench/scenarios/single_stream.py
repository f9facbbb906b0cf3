"""One stream on the default model, itemised (issue 38 item 4): the bandwidth limit of a decode step and where a c1
step's time goes, in-process on the served engine (configs/server.yaml's, 2 threads; no HTTP: the served side is
``serve``'s c1 ITL beside these figures).

    python -m bench single-stream [--requests 8] [--tokens 64] [--rounds 3] [--json OUT.json] [--save]

* **Bandwidth**: numpy's read of 512 MiB, one thread and two (``engine-speed``'s probe, in a child), and the
  step's own weights streamed through the matmul kernel at M=1 with nothing else (every layer's four matrices in
  step order, then the head): what the kernels reach on this machine.
* **The limit**: the bytes of weights a decode step reads (each layer's packed matrices and norms, the head; the
  embedding's one row is not counted) ÷ each bandwidth, as tok/s.
* **A step, itemised**: ``serve``'s c1 prompts one request at a time, greedy, ``--tokens`` new tokens, each engine
  step driven here and timed by part through the engine's own collaborators (wrapped, nothing else changes): the
  plan, the runner (its Python packing of the rows, the graph's inputs, the MindSpore call, and within it the time
  inside the AOT kernels by kind from their own counters), the row's sampling, detokenizing, stopping and event.
  Decode steps only (the prompt's steps are counted apart).

Each figure is the median over rounds; ``uptime`` is printed with them. Never part of the test suite.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections import defaultdict

import numpy as np

from bench import harness
from bench.harness.paths import SERVER_YAML
from bench.scenarios.engine_speed import run_bandwidth_child
from bench.serving.scenarios import PROMPTS


def served_engine():
    """The engine ``mindserve serve`` builds from configs/server.yaml (its first model, 2 threads)."""
    import yaml

    from backends.mindspore.engine.engine import Engine
    from service.config import server_config_from_data

    cfg = yaml.safe_load(SERVER_YAML.read_text())
    cfg["BackendConfig"]["ModelDeployConfig"].setdefault("threads", 2)
    model = server_config_from_data(cfg, SERVER_YAML).models[0]
    return Engine(model.weight_path, model.engine)


class Parts:
    """Seconds and calls per named part, by wrapping callables in place (``wrap``); ``undo`` puts them back."""

    def __init__(self) -> None:
        self.sec: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, part: str) -> None:
        fn = getattr(owner, name)
        sec, calls = self.sec, self.calls

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sec[part] += time.perf_counter() - t
                calls[part] += 1

        self._undo.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else None))
        setattr(owner, name, timed)

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is not None:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._undo.clear()

    def reset(self) -> None:
        self.sec.clear()
        self.calls.clear()


def instrument(engine, parts: Parts) -> None:
    """Wrap the engine's collaborators on the c1 path, each under the name of its part."""
    from backends.base import RequestHandle
    from backends.mindspore.engine.sequence import SeqState
    from backends.mindspore.modeldir.tokenizer import IncrementalDetokenizer
    from backends.sampling import NextTokenChooser
    from backends.stopping import Stopper

    runner = engine.runner
    parts.wrap(engine.scheduler, "plan", "plan")
    parts.wrap(engine.speculator, "propose", "propose")
    parts.wrap(engine, "_admit", "admit")
    parts.wrap(engine, "_drop_cancelled", "cancelled")
    parts.wrap(engine.masks, "start", "masks")
    parts.wrap(runner, "run", "runner.run")
    parts.wrap(runner, "_call", "graph call")
    parts.wrap(runner, "graph_inputs", "graph inputs")
    parts.wrap(runner.net, "arguments", "graph inputs")
    parts.wrap(engine, "_advance", "row")
    record = engine.step_stats.record
    engine.step_stats.record = lambda kind, *a: (parts.calls.__setitem__(f"{kind} step", 1), record(kind, *a))[1]
    parts.wrap(NextTokenChooser, "choose_with_top", "sample")
    parts.wrap(IncrementalDetokenizer, "push", "detokenize")
    parts.wrap(Stopper, "push", "stop")
    parts.wrap(RequestHandle, "emit", "emit")
    parts.wrap(SeqState, "advance", "advance")


def stream(engine, prompt: str, tokens: int, parts: Parts) -> dict:
    """One greedy request of up to ``tokens`` new tokens, its engine steps driven here: per decode step,
    ms of each part and of the kernels by kind."""
    from backends.mindspore.kernels import KERNEL_KINDS, kernel_stats
    from backends.types import RequestParams

    handle = engine.submit(prompt, RequestParams(max_new_tokens=tokens, do_sample=False))  # as serve sends it
    decode: dict[str, list[float]] = defaultdict(list)
    prefill_ms: list[float] = []
    while True:
        parts.reset()
        for kind in KERNEL_KINDS:
            kernel_stats(reset=True, kind=kind)
        t = time.perf_counter()
        worked = engine.step()
        step = time.perf_counter() - t
        if not worked:
            break
        if parts.calls.get("prefill step"):
            prefill_ms.append(step * 1e3)
            continue
        decode["step"].append(step * 1e3)
        for name, sec in parts.sec.items():
            decode[name].append(sec * 1e3)
        for kind in KERNEL_KINDS:
            decode[f"kernel {kind}"].append(kernel_stats(kind=kind)[1] * 1e3)
    result = handle.result(timeout=5)
    return {"decode": decode, "prefill_ms": prefill_ms, "ids": [tok.id for tok in result.tokens]}


def weight_bytes(runner) -> dict[str, int]:
    """Bytes of weights one decode step reads: the layers' (matrices and norms), the final norm's, the head's."""
    out = {"layers": 0, "norm": 0, "head": 0}
    for p in runner.net.get_parameters():
        name, nbytes = p.name, int(np.prod(p.shape)) * p.itemsize
        if "cache" in name or name.startswith("rope_"):
            continue  # the KV cache (read per key, not per weight) and the rotary tables (one row a token)
        out["head" if name.endswith("head") else "layers" if name.startswith("layers.") else "norm"] += nbytes
    return out


def kernel_stream(runner, rounds: int) -> dict[str, float]:
    """ms to stream the step's packed matrices through ``mindserve_qmatmul_packed_raw`` at M=1, 2 threads: all the
    layers' in step order, then the head alone; medians of ``rounds`` (after one untimed pass)."""
    from backends.mindspore.kernels import kernel_library

    lib = kernel_library()
    lib.mindserve_qmatmul_packed_raw.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                                                 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3)
    spec = runner.spec
    d, f = spec.hidden_size, spec.intermediate_size
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    shapes = {"wqkv": (d, qkv), "wo": (spec.num_heads * spec.head_dim, d), "w_gate_up": (d, 2 * f),
              "w_down": (f, d)}
    layers, head = [], None
    for p in runner.net.get_parameters():
        short = p.name.rsplit(".", 1)[-1]
        if short in shapes:
            layers.append((p.asnumpy(), *shapes[short]))
        elif p.name.endswith("head"):
            head = (p.asnumpy(), d, spec.vocab_size)
    x = np.random.default_rng(0).standard_normal((1, max(d, f))).astype(np.float32)
    out = np.empty((1, max(spec.vocab_size, 2 * f)), np.float32)

    def run(mats) -> float:
        t = time.perf_counter()
        for packed, k, n in mats:
            lib.mindserve_qmatmul_packed_raw(x.ctypes.data, packed.ctypes.data, packed.shape[1], None,
                                             out.ctypes.data, 1, k, n)
        return (time.perf_counter() - t) * 1e3

    lib.mindserve_matmul_set_threads(2)
    res = {}
    for name, mats in (("layers", layers), ("head", [head])):
        run(mats)
        res[name] = statistics.median(run(mats) for _ in range(rounds))
    return res


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def summarize(res: dict) -> list[str]:
    """The report's lines: bandwidth and limits, then the median decode step by part."""
    wb, bw, ks = res["weights"], res["bandwidth"], res["kernel_stream_ms"]
    total = sum(wb.values())
    lines = [f"weights read per token: {total / 1e6:.1f} MB (layers {wb['layers'] / 1e6:.1f}, head "
             f"{wb['head'] / 1e6:.1f}, norms {wb['norm'] / 1e6:.2f})"]
    one, two = statistics.median(bw["one"]), statistics.median(bw["two"])
    kern = (wb["layers"] + wb["head"]) / ((ks["layers"] + ks["head"]) / 1e3) / 1e9
    for label, gbs in (("numpy read, 1 thread", one), ("numpy read, 2 threads", two),
                       ("the matmul kernel alone, M=1, 2 threads", kern)):
        lines.append(f"  {label:42s} {gbs:6.1f} GB/s -> limit {gbs * 1e9 / total:6.1f} tok/s "
                     f"({total / gbs / 1e6:.2f} ms a step)")
    lines.append(f"  kernel alone: layers {ks['layers']:.2f} ms ({ks['layers'] / res['num_layers']:.3f} a layer), "
                 f"head {ks['head']:.2f} ms")
    dec = res["decode_ms"]
    step = dec["step"]
    lines.append(f"decode step (median of {res['steps']} steps over {res['requests']} requests x {res['rounds']} "
                 f"rounds): {step:.3f} ms = {1e3 / step:.1f} tok/s = {100 * total / 1e6 / step / one:.0f}% of the "
                 f"1-thread limit, {100 * total / 1e6 / step / two:.0f}% of the 2-thread one, "
                 f"{100 * (ks['layers'] + ks['head']) / step:.0f}% of the kernel-alone time")
    kernels = sum(v for k, v in dec.items() if k.startswith("kernel "))
    rows = [("inside the AOT kernels", kernels)]
    rows += [(f"  {k}", v) for k, v in dec.items() if k.startswith("kernel ")]
    graph = dec.get("graph call", 0.0)
    inputs = dec.get("graph inputs", 0.0)
    rows += [("graph call outside the kernels (MindSpore launch, Tensor in/out)", graph - inputs - kernels),
             ("graph inputs (numpy, net.arguments)", inputs),
             ("runner packing (rows -> arrays, outputs)", dec.get("runner.run", 0.0) - graph),
             ("plan (scheduler)", dec.get("plan", 0.0)), ("drafts (speculator.propose)", dec.get("propose", 0.0)),
             ("sample (chooser)", dec.get("sample", 0.0)), ("detokenize", dec.get("detokenize", 0.0)),
             ("stop", dec.get("stop", 0.0)), ("emit (token event)", dec.get("emit", 0.0)),
             ("admit, cancelled, grammar masks", sum(dec.get(k, 0.0) for k in ("admit", "cancelled", "masks"))),
             ("row, rest (advance glue, Token)", dec.get("row", 0.0) - sum(dec.get(k, 0.0) for k in
                                                                            ("sample", "detokenize", "stop", "emit"))),
             ("step, rest (loop glue, stats, these wrappers)", step - dec.get("runner.run", 0.0) - dec.get("plan", 0.0)
              - dec.get("propose", 0.0) - dec.get("row", 0.0)
              - sum(dec.get(k, 0.0) for k in ("admit", "cancelled", "masks")))]
    lines += [f"  {name:66s} {ms:7.3f} ms" for name, ms in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    harness.add_output_arguments(ap)
    args = ap.parse_args(argv)
    print(f"uptime: {open('/proc/loadavg').read().strip()}", flush=True)
    bandwidth = run_bandwidth_child(5)
    engine = served_engine()
    runner = engine.runner
    weights = weight_bytes(runner)  # before close: a closed engine's parameters are given back
    ks = [kernel_stream(runner, 5) for _ in range(args.rounds)]
    parts = Parts()
    instrument(engine, parts)
    samples: dict[str, list[float]] = defaultdict(list)
    ids: list[list[int]] = []
    try:
        for _ in range(args.rounds):
            for prompt in prompts(args.requests):
                one = stream(engine, prompt, args.tokens, parts)
                ids.append(one["ids"])
                for k, v in one["decode"].items():
                    samples[k].extend(v)
    finally:
        parts.undo()
        engine.close()
    res = {"weights": weights, "bandwidth": {k: bandwidth[k] for k in ("one", "two")},
           "kernel_stream_ms": {k: statistics.median(r[k] for r in ks) for k in ks[0]},
           "num_layers": runner.spec.num_layers, "decode_ms": {k: statistics.median(v) for k, v in samples.items()},
           "steps": len(samples["step"]), "requests": args.requests, "rounds": args.rounds,
           "loadavg": os.getloadavg(), "ids": ids}
    print("\n".join(summarize(res)))
    print(f"uptime: {open('/proc/loadavg').read().strip()}")
    harness.save_results(args, "single-stream", res, bandwidth=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
