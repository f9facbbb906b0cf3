"""``python -m bench COMMAND [ARGS...]``: every measurement of mindserve, one command each.

Each command is a module whose ``main()`` parses ``sys.argv``; ``python -m bench COMMAND --help`` shows its
options. They build engines and start servers through ``bench/harness`` and write one record format (``--json
PATH``, ``--save``: ``bench/results/<scenario>-<date>-<host>.json``).
"""
from __future__ import annotations

import importlib
import sys

# command → (module, what it measures or makes)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("bench.serve_bench", "served throughput and latency, mindserve against llama.cpp (the headline)"),
    "engine-speed": ("bench.scenarios.engine_speed", "the engine offline: load, warm-up, decode, prefill, profile"),
    "step-overhead": ("bench.scenarios.step_overhead", "one decode step of two or more source trees, side by side"),
    "kv-cache-dtype": ("bench.scenarios.kv_cache_dtype", "each KV cache format: logit error and step time"),
    "lora-step": ("bench.scenarios.lora_step", "LoRA adapters' cost per decode step"),
    "speculative-speed": ("bench.scenarios.speculative_speed", "prompt-lookup speculation through the engine"),
    "spec-steps": ("bench.scenarios.spec_steps", "a speculative step's parts on the served engine, arms alternated"),
    "structured": ("bench.scenarios.structured_bench", "constrained (grammar) against free generation"),
    "soak": ("bench.scenarios.soak", "64 clients for 10 minutes; the slow-client flood"),
    "capped-start": ("bench.scenarios.capped_start", "one server start under a hard memory cap"),
    "multi-model": ("bench.scenarios.multi_model", "several models in one server: RSS and switch times"),
    "llama-agreement": ("bench.scenarios.llama_agreement", "greedy ids and margins against llama-server"),
    "llama-float-order": ("bench.scenarios.llama_float_order", "llama.cpp's quantized dot products against ours"),
    "vocab-step": ("bench.scenarios.vocab_step", "a large vocabulary's head, sampler and embedding, part by part"),
    "vocab-split": ("bench.scenarios.vocab_split", "a large-vocabulary decode step on the engine, part by part"),
    "qmatmul-step": ("bench.qmatmul_step", "the quantized matmul per kernel variant, M=1..16"),
    "make-random-gguf": ("bench.make_random_gguf", "(a tool) a random-weight GGUF of a real model's shape"),
    "make-f32-gguf": ("bench.make_f32_gguf", "(a tool) the all-F32 GGUF serve gives llama.cpp"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {doc}" for name, (_, doc) in COMMANDS.items())
    return f"usage: python -m bench COMMAND [ARGS...]   (COMMAND --help for its options)\n\ncommands:\n{rows}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"python -m bench: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    sys.argv = [f"python -m bench {command}", *rest]  # each main parses sys.argv; the record keeps the command
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main())
