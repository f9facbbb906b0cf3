"""Write a random-weight GGUF of a Llama-family shape with the default model's tokenizer.

    python bench/make_random_gguf.py smollm2-1.7b /tmp/smollm2-1.7b.Q4_1.gguf --type Q4_1
    python bench/make_random_gguf.py qwen3-4b OUT.gguf --type Q4_K_M        # via llama-quantize on an F16 copy
    python bench/make_random_gguf.py --list

The text such a model writes is noise; its speed and memory are those of the real shape. The tokenizer
metadata (every ``tokenizer.*`` key) is copied from the default model's GGUF (SmolLM2-135M-Instruct), so
every preset's vocabulary is its 49152 tokens (Qwen3's real 151936 would make the embedding 3x larger).
Weights are drawn N(0, 1/fan_in) tensor by tensor, quantized with ``gguf.quants.quantize`` in row chunks and
streamed to the file, so memory stays at one tensor's blocks plus one chunk of floats. F32 / F16 / Q8_0 /
Q4_0 / Q4_1 are written directly (the embedding and output matrices as Q8_0 for Q4_0/Q4_1, as llama.cpp's
own Q4 files of SmolLM2 have them; norms and the MoE router float32); K-quants (``Q4_K_M``, ``Q5_K_M``,
``Q6_K``, ...) are made by llama.cpp's ``llama-quantize`` (``~/.cache/llama-anchors``, built by
``../shared/tools/build-llama-anchors.sh``) from a temporary F16 file.
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ANCHORS = Path.home() / ".cache" / "llama-anchors"
TOKENIZER_GGUF = ANCHORS / "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHS = ("llama", "qwen3", "qwen3moe")
DIRECT = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")  # written by the gguf package
CHUNK_FLOATS = 1 << 24  # floats drawn and quantized at a time (64 MiB)


@dataclass(frozen=True, slots=True)
class Shape:
    """One model shape, in llama.cpp's terms (``head_dim`` 0: hidden / heads)."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 49152  # the default model's tokenizer
    tied: bool = True
    head_dim: int = 0
    context: int = 8192
    rope_theta: float = 100000.0
    experts: int = 0  # qwen3moe: routed experts per layer, of which experts_used per token, each of width ffn
    experts_used: int = 0

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


PRESETS = {
    "tiny": Shape("llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, context=256),
    "smollm2-135m": Shape("llama", hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536),
    "smollm2-1.7b": Shape("llama", hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192),
    # Qwen3-4B: 2560 x 36, 32 heads of 128 (q is 4096 wide), 8 kv heads, ffn 9728, tied; vocab here 49152.
    "qwen3-4b": Shape("qwen3", hidden=2560, layers=36, heads=32, kv_heads=8, ffn=9728, head_dim=128,
                      context=40960, rope_theta=1000000.0),
    # A Qwen3-30B-A3B-like layer at a size this machine holds: 1.9B parameters, 0.4B read per token.
    "qwen3moe-small": Shape("qwen3moe", hidden=1024, layers=16, heads=16, kv_heads=4, ffn=768, head_dim=128,
                            experts=64, experts_used=8, context=40960, rope_theta=1000000.0),
    # A smaller one (docs/performance.md's MoE row): 16 experts of width 768, 4 per token, 1024 x 12.
    "qwen3moe-16x4": Shape("qwen3moe", hidden=1024, layers=12, heads=16, kv_heads=4, ffn=768, head_dim=128,
                           experts=16, experts_used=4, context=40960, rope_theta=1000000.0),
}


def tensor_plan(shape: Shape, wtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of the file: (GGUF name, numpy shape [out, in], GGML type name)."""
    big = "Q8_0" if wtype in ("Q4_0", "Q4_1") else wtype  # embedding / output matrix
    h, d = shape.hidden, shape.dim
    plan = [("token_embd.weight", (shape.vocab, h), big), ("output_norm.weight", (h,), "F32")]
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, h), big))
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), "F32"),
                 (b + "attn_q.weight", (shape.heads * d, h), wtype),
                 (b + "attn_k.weight", (shape.kv_heads * d, h), wtype),
                 (b + "attn_v.weight", (shape.kv_heads * d, h), wtype),
                 (b + "attn_output.weight", (h, shape.heads * d), wtype),
                 (b + "ffn_norm.weight", (h,), "F32")]
        if shape.arch in ("qwen3", "qwen3moe"):
            plan += [(b + "attn_q_norm.weight", (d,), "F32"), (b + "attn_k_norm.weight", (d,), "F32")]
        if shape.experts:
            e, f = shape.experts, shape.ffn
            plan += [(b + "ffn_gate_inp.weight", (e, h), "F32"),
                     (b + "ffn_gate_exps.weight", (e, f, h), wtype), (b + "ffn_up_exps.weight", (e, f, h), wtype),
                     (b + "ffn_down_exps.weight", (e, h, f), wtype)]
        else:
            plan += [(b + "ffn_gate.weight", (shape.ffn, h), wtype), (b + "ffn_up.weight", (shape.ffn, h), wtype),
                     (b + "ffn_down.weight", (h, shape.ffn), wtype)]
    return plan


def parameters(shape: Shape) -> tuple[int, int]:
    """(all parameters, parameters read per token: the routed experts' share only)."""
    total = active = 0
    for name, dims, _ in tensor_plan(shape, "F32"):
        n = int(np.prod(dims))
        total += n
        active += n * shape.experts_used // shape.experts if "_exps" in name else n
    return total, active


def _metadata(writer, shape: Shape, wtype: str, tokenizer_gguf: Path) -> None:
    import gguf

    writer.add_name(f"random {shape.arch} {shape.hidden}x{shape.layers}")
    writer.add_file_type(int(getattr(gguf.LlamaFileType, f"MOSTLY_{wtype}", gguf.LlamaFileType.ALL_F32)))
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6 if shape.arch != "llama" else 1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.dim)
    if shape.head_dim:
        writer.add_key_length(shape.dim)
        writer.add_value_length(shape.dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.ffn)
    fields = tokenizer_fields(tokenizer_gguf)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    tokens = next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens")
    if len(tokens) != shape.vocab:
        raise ValueError(f"vocab {shape.vocab}: the tokenizer of {tokenizer_gguf.name} has {len(tokens)} tokens")


@functools.cache
def tokenizer_fields(path: Path) -> tuple[tuple[str, Any, Any, Any], ...]:
    """Every ``tokenizer.*`` key of a GGUF file: (key, value, GGUF type, array item type); read once (~6 s)."""
    import gguf

    return tuple((key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
                 for key, field in gguf.GGUFReader(str(path)).fields.items() if key.startswith("tokenizer."))


def _blocks(rng: np.random.Generator, dims: tuple[int, ...], kind: str) -> np.ndarray:
    """One tensor's data: norms ones, matrices N(0, 1/fan_in) as ``kind`` (float16/32, or uint8 blocks
    ``[..., row bytes]``), drawn and quantized CHUNK_FLOATS at a time."""
    import gguf
    from gguf.quants import quantize

    if len(dims) == 1:
        return np.ones(dims, np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    fan_in, rows = dims[-1], int(np.prod(dims[:-1]))
    per_chunk = max(1, CHUNK_FLOATS // fan_in)
    parts = []
    for start in range(0, rows, per_chunk):
        n = min(per_chunk, rows - start)
        x = rng.standard_normal((n, fan_in), dtype=np.float32)
        x *= np.float32(fan_in ** -0.5)
        parts.append(x if kind == "F32" else x.astype(np.float16) if kind == "F16" else quantize(x, qtype))
    data = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return data.reshape(*dims[:-1], data.shape[-1])


def write(shape: Shape, out: Path, wtype: str, *, seed: int = 0, tokenizer_gguf: Path = TOKENIZER_GGUF,
          progress: bool = True) -> Path:
    """Write ``out`` with weights of ``wtype`` (one of ``DIRECT``), streaming tensor by tensor."""
    import gguf

    if wtype not in DIRECT:
        raise ValueError(f"type {wtype!r}: written directly are {', '.join(DIRECT)} (K-quants via llama-quantize)")
    if shape.arch not in ARCHS:
        raise ValueError(f"arch {shape.arch!r}: one of {', '.join(ARCHS)}")
    if shape.experts and shape.arch != "qwen3moe":
        raise ValueError(f"arch {shape.arch!r} has no routed experts (qwen3moe has)")
    plan = tensor_plan(shape, wtype)
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    _metadata(writer, shape, wtype, tokenizer_gguf)
    for name, dims, kind in plan:
        qtype = gguf.GGMLQuantizationType[kind]
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        if dims[-1] % block:
            raise ValueError(f"{name} {dims}: rows of {dims[-1]} are not whole {kind} blocks of {block}")
        size = int(np.prod(dims[:-1])) * dims[-1] // block * nbytes
        if kind in ("F32", "F16"):
            writer.add_tensor_info(name, dims, np.dtype(np.float32 if kind == "F32" else np.float16), size)
        else:
            writer.add_tensor_info(name, (*dims[:-1], dims[-1] // block * nbytes), np.dtype(np.uint8), size,
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng, t0, done, total = np.random.default_rng(seed), time.perf_counter(), 0, sum(int(np.prod(d)) for _, d, _ in plan)
    for i, (name, dims, kind) in enumerate(plan):
        writer.write_tensor_data(_blocks(rng, dims, kind))
        done += int(np.prod(dims))
        if progress and (len(dims) > 1 or i + 1 == len(plan)):
            print(f"\r  {i + 1}/{len(plan)} tensors, {done / 1e9:.2f}/{total / 1e9:.2f} G parameters, "
                  f"{time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    writer.close()
    tmp.replace(out)
    return out


def llama_quantize(f16: Path, out: Path, ftype: str, binary: Path = ANCHORS / "llama-quantize") -> Path:
    """``out`` as llama.cpp's ``llama-quantize`` makes ``ftype`` (e.g. Q4_K_M) from the F16 file ``f16``."""
    if not binary.exists():
        raise FileNotFoundError(f"type {ftype}: K-quants are made by {binary}, which is missing (build it with "
                                "../shared/tools/build-llama-anchors.sh)")
    env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    subprocess.run([str(binary), str(f16), str(out), ftype, "2"], check=True, env=env)
    return out


def make(shape: Shape, out: Path, wtype: str, *, seed: int = 0, tokenizer_gguf: Path = TOKENIZER_GGUF,
         progress: bool = True) -> Path:
    """``out`` of any type: written directly, or via an F16 file beside it that llama-quantize reads."""
    if wtype in DIRECT:
        return write(shape, out, wtype, seed=seed, tokenizer_gguf=tokenizer_gguf, progress=progress)
    f16 = out.with_name(out.name + ".f16.gguf")
    try:
        write(shape, f16, "F16", seed=seed, tokenizer_gguf=tokenizer_gguf, progress=progress)
        return llama_quantize(f16, out, wtype)
    finally:
        f16.unlink(missing_ok=True)


def _default_tokenizer_gguf() -> Path:
    if TOKENIZER_GGUF.exists():
        return TOKENIZER_GGUF
    from backends.mindspore.sources.default_model import ensure_default_gguf  # only when the anchors copy is absent

    return ensure_default_gguf(Path(__file__).resolve().parent.parent / ".cache" / "models")  # bench/harness/paths.py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", choices=sorted(PRESETS), help="the model shape")
    parser.add_argument("out", nargs="?", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", default="Q4_1", help=f"{', '.join(DIRECT)}, or a llama-quantize type (Q4_K_M, ...)")
    parser.add_argument("--arch", choices=ARCHS, help="write the preset as this architecture (default: the preset's)")
    parser.add_argument("--layers", type=int, help="override the preset's layer count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-gguf", type=Path, help=f"tokenizer source (default {TOKENIZER_GGUF})")
    parser.add_argument("--list", action="store_true", help="print the presets and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, s in PRESETS.items():
            total, active = parameters(s)
            print(f"{name:15} {total / 1e9:6.2f} B parameters ({active / 1e9:.2f} B per token)  {asdict(s)}")
        return 0
    if args.preset is None or args.out is None:
        parser.error("preset and out are required (or --list)")
    shape = PRESETS[args.preset]
    if args.arch:
        shape = replace(shape, arch=args.arch)
    if args.layers:
        shape = replace(shape, layers=args.layers)
    t0 = time.perf_counter()
    make(shape, args.out, args.type, seed=args.seed, tokenizer_gguf=args.tokenizer_gguf or _default_tokenizer_gguf())
    total, _ = parameters(shape)
    print(f"wrote {args.out}: {args.preset} ({shape.arch}, {total / 1e9:.2f} B parameters) as {args.type}, "
          f"{args.out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
