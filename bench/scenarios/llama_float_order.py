"""How far float order alone moves a quantized model: mindserve's quantized dot products against llama.cpp's own.

    .venv/bin/python -m bench llama-float-order [--gguf FILE] [--tokens 504,3280,...] [--llama-dir DIR]

llama.cpp's CPU library (``libggml-cpu.so`` of ``../shared/tools/build-llama-anchors.sh``'s build) exports the
activation quantizers and dot products its matmuls run (``quantize_row_q8_0`` / ``q8_1`` / ``q8_K``,
``ggml_vec_dot_<fmt>_q8_<x>``); this script calls them through ctypes on the GGUF's own blocks and compares them
with mindserve's arithmetic (``tests/support/kernel_ref.qmatmul``, which every kernel variant matches bit for bit:
test_reference_bits, test_variants). For a one-token prompt of a ``llama``-architecture GGUF (attention over one
position is its value row, so no attention kernel is involved) it runs the model's forward in NumPy three times,
identical except for the matmuls: llama.cpp's dot products, mindserve's, and float64 on the dequantized weights.
It prints, per matmul, how far the two quantized results are apart on the real activations, and at the end how
far the three forwards' log-probabilities are apart at the top-10 tokens: the per-matmul differences are float
order (~1e-7 relative), and the forwards show how the activations' 8-bit rounding amplifies them layer by layer.
Never run by the test suite (it needs the llama.cpp build).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

from bench import harness
from bench.harness.paths import CACHE_DIR, LLAMA_ANCHORS

F32 = np.float32
# GGUF weight format -> (llama.cpp's activation quantizer, its dot product, bytes of one activation block, block size)
LLAMA_DOT = {
    "q8_0": ("quantize_row_q8_0", "ggml_vec_dot_q8_0_q8_0", 34, 32),
    "q4_0": ("quantize_row_q8_0", "ggml_vec_dot_q4_0_q8_0", 34, 32),
    "q5_0": ("quantize_row_q8_0", "ggml_vec_dot_q5_0_q8_0", 34, 32),
    "q4_1": ("quantize_row_q8_1", "ggml_vec_dot_q4_1_q8_1", 36, 32),
    "q5_1": ("quantize_row_q8_1", "ggml_vec_dot_q5_1_q8_1", 36, 32),
    "q4_k": ("quantize_row_q8_K", "ggml_vec_dot_q4_K_q8_K", 292, 256),
    "q5_k": ("quantize_row_q8_K", "ggml_vec_dot_q5_K_q8_K", 292, 256),
    "q6_k": ("quantize_row_q8_K", "ggml_vec_dot_q6_K_q8_K", 292, 256),
}


class LlamaDots:
    """llama.cpp's activation quantization and dot products, one output at a time, as its CPU matmul runs them."""

    def __init__(self, libdir: Path) -> None:
        for dep in ("libggml-base.so", "libggml-cpu.so"):  # the CPU library needs the base one loaded first
            lib = ctypes.CDLL(str(libdir / dep), mode=ctypes.RTLD_GLOBAL)
        self.lib = lib
        self.lib.ggml_cpu_init()  # fills the fp16 tables the dot products read

    def matmul(self, x: np.ndarray, w) -> np.ndarray:
        quantize, dot, act_bytes, block = LLAMA_DOT[w.fmt]
        x = np.ascontiguousarray(x, F32)
        qx = (ctypes.c_uint8 * (w.cols // block * act_bytes))()
        getattr(self.lib, quantize)(x.ctypes.data_as(ctypes.c_void_p), qx, ctypes.c_int64(w.cols))
        fn, out, s = getattr(self.lib, dot), np.zeros(w.rows, F32), ctypes.c_float()
        for i in range(w.rows):
            fn(ctypes.c_int(w.cols), ctypes.byref(s), ctypes.c_size_t(0), w.blocks[i].ctypes.data_as(ctypes.c_void_p),
               ctypes.c_size_t(0), qx, ctypes.c_size_t(0), ctypes.c_int(1))
            out[i] = s.value
        return out


class Model:
    """A llama-architecture GGUF's weights and the one-token forward (no attention kernel: one position)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        from backends.mindspore.modeldir.quant import QuantWeight, dequantize

        reader = GGUFReader(str(path))
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        if arch != "llama":
            raise SystemExit(f"{path.name}: general.architecture is {arch!r}; this script runs 'llama' only")
        meta = {k: v.parts[-1][0] for k, v in reader.fields.items() if k.startswith("llama.")}
        self.layers = int(meta["llama.block_count"])
        self.heads, self.kv = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        self.tensors = {t.name: t for t in reader.tensors}
        self.weights: dict[str, object] = {}
        self._quant, self._dequantize = QuantWeight, dequantize
        self.head_name = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    def weight(self, name: str):
        if name not in self.weights:
            t = self.tensors[name]
            cols, rows = int(t.shape[0]), int(t.shape[1])
            blocks = np.ascontiguousarray(np.asarray(t.data, np.uint8)).reshape(rows, -1)
            self.weights[name] = self._quant(t.tensor_type.name.lower(), rows, cols, blocks)
        return self.weights[name]

    def vector(self, name: str) -> np.ndarray:
        return np.asarray(self.tensors[name].data, F32).reshape(-1)

    def rmsnorm(self, x: np.ndarray, name: str) -> np.ndarray:
        return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + self.eps)).astype(F32) * self.vector(name)

    def forward(self, token: int, matmul) -> np.ndarray:
        """Log-probabilities after a one-token prompt, every matmul by ``matmul(x, weight)``."""
        x = self._dequantize(self.weight("token_embd.weight"))[token].astype(F32)
        for i in range(self.layers):
            p = f"blk.{i}."
            v = matmul(self.rmsnorm(x, p + "attn_norm.weight"), self.weight(p + "attn_v.weight"))
            hd = v.size // self.kv
            att = np.concatenate([v[(h * self.kv // self.heads) * hd:][:hd] for h in range(self.heads)])
            x = (x + matmul(att, self.weight(p + "attn_output.weight"))).astype(F32)
            h = self.rmsnorm(x, p + "ffn_norm.weight")
            g, u = matmul(h, self.weight(p + "ffn_gate.weight")), matmul(h, self.weight(p + "ffn_up.weight"))
            act = (g / (1 + np.exp(-g.astype(np.float64)))).astype(F32) * u
            x = (x + matmul(act, self.weight(p + "ffn_down.weight"))).astype(F32)
        logits = matmul(self.rmsnorm(x, "output_norm.weight"), self.weight(self.head_name)).astype(np.float64)
        return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="a llama-architecture GGUF (default: the default model's)")
    ap.add_argument("--tokens", default="504,3280,5965,788,36971", help="one-token prompts (comma-separated ids)")
    ap.add_argument("--llama-dir", type=Path, default=LLAMA_ANCHORS, help="the llama.cpp build's library directory")
    harness.add_output_arguments(ap)
    args = ap.parse_args(argv)

    from backends.mindspore.sources.default_model import ensure_default_gguf
    from backends.mindspore.modeldir.quant import dequantize
    from tests.support import kernel_ref

    gguf = args.gguf or ensure_default_gguf(CACHE_DIR)
    model, llama = Model(gguf), LlamaDots(args.llama_dir)
    dense: dict[int, np.ndarray] = {}

    def ours(x, w):
        return kernel_ref.qmatmul(np.asarray(x, F32)[None], w)[0]

    def exact(x, w):
        if id(w) not in dense:
            dense[id(w)] = dequantize(w).astype(np.float64)
        return (dense[id(w)] @ np.asarray(x, np.float64)).astype(F32)

    rel: dict[str, list[float]] = {}

    def both(x, w):  # llama.cpp's result goes on; the distance of mindserve's on the same input is recorded
        a, b = llama.matmul(x, w), ours(x, w)
        rel.setdefault(w.fmt, []).append(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
        return a

    print(f"{gguf.name}: {model.layers} layers, one-token prompts {args.tokens}; log-probability distances are the "
          f"mean |difference| at llama.cpp's top-10 tokens")
    rows = []
    for token in (int(t) for t in args.tokens.split(",")):
        lp_llama = model.forward(token, both)
        lp_ours, lp_exact = model.forward(token, ours), model.forward(token, exact)
        top = np.argsort(lp_llama)[-10:]
        d_ours = float(np.abs(lp_llama[top] - lp_ours[top]).mean())
        d_exact_llama = float(np.abs(lp_llama[top] - lp_exact[top]).mean())
        d_exact_ours = float(np.abs(lp_ours[top] - lp_exact[top]).mean())
        rows.append((d_ours, d_exact_llama, d_exact_ours))
        print(f"  token {token:>6}: llama.cpp's dots vs mindserve's {d_ours:.4f}; vs float64 weights: llama.cpp "
              f"{d_exact_llama:.4f}, mindserve {d_exact_ours:.4f}")
    for fmt, r in sorted(rel.items()):
        print(f"  {fmt} matmuls on the forwards' own activations: |llama.cpp - mindserve| / max|llama.cpp| median "
              f"{np.median(r):.2g}, max {max(r):.2g} ({len(r)} matmuls)")
    m = np.mean(rows, axis=0)
    print(f"mean over the prompts: llama.cpp vs mindserve {m[0]:.4f}; each against float64: llama.cpp {m[1]:.4f}, "
          f"mindserve {m[2]:.4f}")
    harness.save_results(args, "llama-float-order", {
        "gguf": str(gguf), "tokens": args.tokens,
        "per_token": [dict(zip(("llama_vs_ours", "exact_vs_llama", "exact_vs_ours"), r)) for r in rows],
        "matmul_rel": {fmt: {"median": float(np.median(r)), "max": max(r), "count": len(r)} for fmt, r in rel.items()}})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
