"""PNG charts of the benchmark results, drawn from the scripts' JSON so a chart can be redrawn without
re-running: ``serve_chart`` (serve_bench.py: throughput and TTFT by concurrency, one line per target) and
``decode_breakdown_chart`` (engine_speed.py: where a decode step's time goes, at B=1 and B=16).

matplotlib is a bench dependency (``pip install -e '.[bench]'``), not the server's.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

try:
    import matplotlib
except ImportError as exc:  # the scripts import this module before a long run, so this stops them at once
    raise SystemExit(f"charts need matplotlib ({exc}): pip install -e '.[bench]'") from None

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

DPI = 150
TARGET_COLORS = {"mindserve": "#1f77b4", "mindserve-nocache": "#9467bd", "llama.cpp Q4_1": "#ff7f0e",
                 "llama.cpp F32": "#2ca02c"}
# The kernel counters of engine_speed.py, grouped as docs/performance.md's table groups them.
STEP_PARTS = (("matmul", ("matmul",), "#1f77b4"),
              ("paged attention", ("attention",), "#ff7f0e"),
              ("RMSNorm, SwiGLU, QKV + RoPE", ("rmsnorm", "swiglu", "qkv_rope"), "#2ca02c"),
              ("the rest: MindSpore dispatch, stock ops, host", None, "#b0b0b0"))


def serve_chart(results: dict, path: Path, scenarios: Sequence[str], title: str) -> Path:
    """Throughput (left) and TTFT p50, with p95 dashed (right, log scale), against the scenarios' client
    counts, one line per target; ``scenarios`` are the ones that differ only in concurrency."""
    rows = {name: results["scenarios"][name] for name in scenarios if name in results.get("scenarios", {})}
    if not rows:
        raise ValueError(f"no results for the scenarios {', '.join(scenarios)} in the JSON")
    targets = list(dict.fromkeys(server for by_server in rows.values() for server in by_server))
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(12, 5), dpi=DPI)
    labels: dict[str, list] = {"tput": [], "ttft": []}  # (x, y, text, color), placed once all are known
    for target in targets:
        points = sorted((r["concurrency"], r) for r in (by[target] for by in rows.values() if target in by))
        xs, color = [c for c, _ in points], TARGET_COLORS.get(target)
        tput.plot(xs, [r["tok_per_s"] for _, r in points], "o-", color=color, label=target, linewidth=2)
        ttft.plot(xs, [r["ttft_p50_ms"] for _, r in points], "o-", color=color, linewidth=2)
        ttft.plot(xs, [r["ttft_p95_ms"] for _, r in points], "^--", color=color, alpha=0.55, linewidth=1)
        for x, r in points:
            labels["tput"].append((x, r["tok_per_s"], f"{r['tok_per_s']:.0f}", color))
            labels["ttft"].append((x, r["ttft_p50_ms"], _ms(r["ttft_p50_ms"]), color))
    ticks = sorted({r["concurrency"] for by in rows.values() for r in by.values()})
    names = {r["concurrency"]: name for name, by in rows.items() for r in by.values()}
    for ax in (tput, ttft):
        ax.set_xticks(ticks, [f"{c}\n({names[c]})" for c in ticks])
        ax.set_xlim(ticks[0] - 0.06 * (ticks[-1] - ticks[0] or 1), ticks[-1] + 0.16 * (ticks[-1] - ticks[0] or 1))
        ax.set_xlabel("concurrent clients (scenario)")
        ax.grid(True, alpha=0.3)
    tput.set_ylim(0, max(y for _, y, _, _ in labels["tput"]) * 1.12)
    tput.set_ylabel("generated tokens/s, all clients")
    tput.set_title("throughput (higher is better)", fontsize=10)
    ttft.set_yscale("log")
    low = min(y for _, y, _, _ in labels["ttft"])
    high = max(r["ttft_p95_ms"] for by in rows.values() for r in by.values())
    ttft.set_ylim(low / 1.6, high * 1.6)
    ttft.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _ms(v)))
    narrow = math.log10(ttft.get_ylim()[1] / ttft.get_ylim()[0]) < 1.5  # few decades: label 2, 3 and 5 too
    ttft.yaxis.set_minor_formatter(FuncFormatter(
        lambda v, _: _ms(v) if narrow and f"{v:.0e}"[0] in "235" else ""))
    ttft.set_ylabel("time to first token")
    ttft.set_title("time to first token: p50 solid and labelled, p95 dashed\n(lower is better; log scale)",
                   fontsize=10)
    _label_points(tput, labels["tput"], log=False)
    _label_points(ttft, labels["ttft"], log=True)
    fig.legend(*tput.get_legend_handles_labels(), loc="upper center", ncol=len(targets), fontsize=10,
               frameon=False, bbox_to_anchor=(0.5, 0.95))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return _save(fig, path, tight=False)


def _label_points(ax, labels: list, *, log: bool) -> None:
    """Each value just right of its point, nudged apart vertically where points at one x are close."""
    lo, hi = ax.get_ylim()
    scale = (lambda v: math.log10(v)) if log else (lambda v: v)
    unscale = (lambda v: 10 ** v) if log else (lambda v: v)
    gap = 0.055 * (scale(hi) - scale(lo))
    for x in sorted({x for x, _, _, _ in labels}):
        here = sorted((l for l in labels if l[0] == x), key=lambda l: l[1])
        placed: list[float] = []
        for _, y, _, _ in here:
            placed.append(max(scale(y), placed[-1] + gap) if placed else scale(y))
        shift = max(0.0, (placed[-1] - scale(hi)) + gap / 2) if placed else 0.0  # keep the top one inside
        for (_, _, text, color), at in zip(here, placed):
            ax.annotate(text, (x, unscale(at - shift)), xytext=(9, 0), textcoords="offset points", fontsize=9,
                        color=color, ha="left", va="center", fontweight="bold",
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})


def decode_breakdown_chart(profile: dict, path: Path, title: str) -> Path:
    """Stacked bars of one decode step, per batch size: the time inside each AOT kernel and the rest, per
    step (left) and per generated token (right). ``profile`` is engine_speed.py's ``info["profile"]``."""
    bars = [(label, int(label.removeprefix("B=")), p["kernels"]) for label, p in profile.items()
            if p.get("kernels")]
    if not bars:
        raise ValueError("the JSON has no kernel breakdown (a run with --no-profile, or --kernels stock)")
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.9 + 0.75 * len(bars)), dpi=DPI)
    for ax, per_token in zip(axes, (False, True)):
        widest = max(k["wall_ms"] / (batch if per_token else 1) for _, batch, k in bars)
        for y, (label, batch, k) in enumerate(bars):
            scale = 1 / batch if per_token else 1.0
            left = 0.0
            for name, kinds, color in STEP_PARTS:
                ms = (k["rest_ms"] if kinds is None else sum(k["kinds"][kind]["ms_per_step"] for kind in kinds)) * scale
                ax.barh(y, ms, left=left, height=0.6, color=color, label=name if y == 0 else None, edgecolor="white")
                if ms >= 0.07 * widest:  # label the parts wide enough to hold one
                    ax.text(left + ms / 2, y, f"{ms:.1f}", ha="center", va="center", fontsize=9)
                left += ms
            ax.text(left, y, f"  {left:.1f} ms", va="center", fontsize=9, fontweight="bold")
        ax.set_yticks(range(len(bars)), [label for label, _, _ in bars])
        ax.invert_yaxis()
        ax.set_xlim(0, widest * 1.2)
        ax.set_xlabel("ms per generated token" if per_token else "ms per decode step")
        ax.set_title("per generated token (step ÷ batch)" if per_token else "per step", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(STEP_PARTS), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    inches = fig.get_figheight()
    fig.subplots_adjust(left=0.06, right=0.98, wspace=0.12, top=1 - 0.75 / inches, bottom=1.05 / inches)
    return _save(fig, path, tight=False)


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value / 1e3:.3g} s" if value >= 1000 else f"{value:.3g} ms"


def _save(fig, path: Path, tight: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
