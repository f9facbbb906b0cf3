"""Write an all-F32 copy of a GGUF file: the same metadata, every tensor dequantised to float32.

    python bench/make_f32_gguf.py SRC.gguf DST.gguf [--verify]

The benchmark (bench/serve_bench.py) serves this file with llama.cpp so that llama.cpp runs the
same fp32 weights mindserve runs (mindserve dequantises the Q4_1 GGUF to fp32 when it converts it).
Tensors keep their stored GGUF layout (no un-permuting of Q/K): llama.cpp reads the file exactly as
it reads the quantised one. Every metadata key/value is copied with its GGUF type, except
`general.file_type`, which becomes ALL_F32.

--verify loads DST with llama.cpp (the llama-cpp-python venv, .venv-bench) and checks that its greedy
ids for the golden prompt (tests/golden/smollm2_greedy.json: 20 tokens, no BOS) equal the HF fp32 ids.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Fields the reader synthesises from the header, and one GGUFWriter writes itself.
_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")
_WRITER_OWNED = ("general.architecture",)


def _field_value(field, gguf):
    """The Python value of one reader field, in the shape GGUFWriter.add_key_value takes."""
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        if sub == gguf.GGUFValueType.STRING:
            values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        else:
            values = [field.parts[i].tolist()[0] for i in field.data]
        return values, vtype, sub
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8"), vtype, None
    return field.parts[field.data[0]].tolist()[0], vtype, None


def convert(src: Path, dst: Path, quiet: bool = False) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8")
    tmp = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    n_kv = 0
    for name, field in reader.fields.items():
        if name in _HEADER_FIELDS or name in _WRITER_OWNED:
            continue
        value, vtype, sub = _field_value(field, gguf)
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        if name == "general.alignment":
            writer.data_alignment = int(value)
        writer.add_key_value(name, value, vtype, sub_type=sub)
        n_kv += 1
    if "general.file_type" not in reader.fields:
        writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        n_kv += 1

    t0 = time.perf_counter()
    total_bytes = 0
    types: dict[str, int] = {}
    for i, tensor in enumerate(reader.tensors):
        qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
        types[qtype.name] = types.get(qtype.name, 0) + 1
        # numpy order: the GGUF shape reversed (ne[0] is the fastest-moving dimension).
        np_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if qtype == gguf.GGMLQuantizationType.F32:
            data = np.asarray(tensor.data, dtype=np.float32).reshape(np_shape)
        else:
            data = gguf.quants.dequantize(tensor.data, qtype).astype(np.float32, copy=False).reshape(np_shape)
        writer.add_tensor(tensor.name, np.ascontiguousarray(data))
        total_bytes += data.nbytes
        if not quiet and ((i + 1) % 50 == 0 or i + 1 == len(reader.tensors)):
            print(f"\r  dequantised {i + 1}/{len(reader.tensors)} tensors", end="", file=sys.stderr, flush=True)
    if not quiet:
        print(file=sys.stderr)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    tmp.replace(dst)
    return {"src": str(src), "dst": str(dst), "metadata_keys": n_kv, "tensors": len(reader.tensors),
            "source_types": types, "tensor_bytes": total_bytes, "seconds": round(time.perf_counter() - t0, 1)}


REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden" / "smollm2_greedy.json"
BENCH_VENV_PY = REPO / ".venv-bench" / "bin" / "python"

# Run by the llama-cpp-python venv's python: greedy ids (argmax, EOS not special-cased) as JSON.
_LLAMA_GREEDY = """
import json, sys
from llama_cpp import Llama
path, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
out = []
for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
    out.append(int(tok))
    if len(out) == n:
        break
print(json.dumps({"prompt_ids": [int(i) for i in ids], "generated_ids": out}))
"""


def verify(gguf_path: Path, python: Path = BENCH_VENV_PY) -> bool:
    """llama.cpp's greedy ids on gguf_path for the golden prompt equal the golden (HF fp32) ids."""
    golden = json.loads(GOLDEN.read_text())
    n = len(golden["generated_ids"])
    proc = subprocess.run([str(python), "-c", _LLAMA_GREEDY, str(gguf_path), golden["prompt"], str(n)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp check failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    same_prompt = got["prompt_ids"] == golden["prompt_ids"]
    same = got["generated_ids"] == golden["generated_ids"]
    print(f"llama.cpp on {gguf_path.name}: prompt ids {'=' if same_prompt else '≠'} golden {got['prompt_ids']}")
    print(f"  greedy ids {got['generated_ids']}")
    print(f"  golden ids {golden['generated_ids']} → {'IDENTICAL' if same else 'DIFFERENT'}")
    return same and same_prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="the (quantised) GGUF file")
    parser.add_argument("dst", type=Path, help="the F32 GGUF file to write")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--verify", action="store_true", help="check llama.cpp's greedy ids on DST against "
                        "the HF fp32 golden (needs the llama-cpp-python venv)")
    parser.add_argument("--llama-python", type=Path, default=BENCH_VENV_PY,
                        help="python of the venv with llama-cpp-python (default .venv-bench)")
    args = parser.parse_args(argv)
    if args.src.resolve() == args.dst.resolve():
        parser.error("SRC and DST are the same file")
    info = convert(args.src, args.dst, quiet=args.quiet)
    print(f"wrote {info['dst']}: {info['tensors']} tensors (from {info['source_types']}), "
          f"{info['metadata_keys']} metadata keys, {info['tensor_bytes'] / 1e6:.1f} MB of tensor data, "
          f"{info['seconds']} s")
    if args.verify:
        return 0 if verify(args.dst, args.llama_python) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
