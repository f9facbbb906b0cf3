"""One engine at one thread count, in a process of its own (MindSpore's CPU threads are set once per process):
greedy generations alone and batched, their token ids and every logits row the chooser saw, written to an .npz.

    python -m tests.support.thread_bits MODEL_DIR THREADS OUT.npz [KERNELS]
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

# A prompt of several prefill chunks, and a batch of four decoding together (matmul rows > 1, attention over rows
# of different lengths).
LONG = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "salt, grain and wool. Over the centuries the settlement grew into a market town, then a city with walls, "
        "a cathedral and a university. Tell me what happened next:")
BATCH = ("Write a short poem about the sea.", "What is the capital of France?", "List three prime numbers:",
         "def fibonacci(n):")
NEW_TOKENS = 24


def run(model_dir: Path, threads: int, kernels: str) -> dict[str, np.ndarray]:
    from backends.mindspore.planning.device import mindspore_threads
    from backends.mindspore.engine.engine import Engine
    from backends.mindspore.engine.sequence import SeqState
    from backends.settings import EngineConfig
    from backends.types import RequestParams

    seen: dict[str, list[np.ndarray]] = {}
    plain = SeqState.advance

    def advance(self, logits):
        seen.setdefault(self.handle.request_id, []).append(np.array(logits, dtype=np.float32, copy=True))
        return plain(self, logits)

    SeqState.advance = advance
    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64,
                          block_size=64, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4),
                          threads=threads, kernels=kernels)
    greedy = RequestParams(max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True)  # every row to the end
    out: dict[str, np.ndarray] = {}
    with Engine(model_dir, config) as engine:
        out["engine_threads"] = np.array(engine.threads.count)
        out["mindspore_threads"] = np.array(mindspore_threads())
        out["kernel_threads"] = np.array(_kernel_threads() if engine.runner.kernels == "aot" else 0)
        alone = engine.submit(LONG, greedy)
        runs = [("long", alone, alone.result(timeout=600))]
        # queued from the engine thread between two steps, so one step admits all four whatever the machine's
        # load (submitted from here, the loop could start the first before the others arrive: other row counts)
        handles = engine._between_steps(lambda: [engine.submit(p, greedy) for p in BATCH]).result(timeout=60)
        runs += [(f"batch{i}", h, h.result(timeout=600)) for i, h in enumerate(handles)]
        for name, handle, result in runs:
            out[f"{name}_ids"] = np.array([t.id for t in result.tokens], dtype=np.int64)
            out[f"{name}_logits"] = np.stack(seen[handle.request_id])
    return out


def _kernel_threads() -> int:
    from backends.mindspore.kernels import kernel_library

    return int(kernel_library().mindserve_matmul_get_threads())


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the "threads: N (why)" line
    model_dir, threads, out = Path(argv[0]), int(argv[1]), Path(argv[2])
    kernels = argv[3] if len(argv) > 3 else "auto"  # auto, aot or stock
    np.savez(out, **run(model_dir, threads, kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
