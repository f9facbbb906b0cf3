"""A bare ModelRunner on a small model, for the network tests (and their PyNative subprocess)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from backends.mindspore.families import load_model
from backends.mindspore.planning.device import set_mode
from backends.mindspore.runners import DecodeRow, ModelRunner, PrefillChunk, build_runner
from backends.mindspore.planning.shapes import Shapes
from backends.mindspore.modeldir.weights import load_weights

SHAPES = Shapes(block_size=16, prefill_chunk=8, batch_buckets=(1, 4), window_buckets=(32, 64),
                prefill_batch_buckets=(1, 2))


def make_runner(model_dir: Path, num_blocks: int = 24, mode: int = 0, kernels: str = "stock",
                kernel_isa: str = "auto") -> ModelRunner:
    spec = load_model(model_dir)
    set_mode(mode, "CPU", 2)
    return build_runner(spec, load_weights(spec.checkpoint, spec.checkpoint_format), SHAPES, num_blocks, kernels,
                        kernel_isa=kernel_isa)


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def greedy(runner: ModelRunner, ids: list[int], steps: int, blocks: list[int]) -> tuple[list[int], np.ndarray]:
    """The prompt prefilled, then ``steps`` greedy tokens: (the tokens, the logits of every step [steps + 1, V])."""
    logits = [prefill(runner, ids, blocks)]
    tokens: list[int] = []
    for i in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(runner.decode([DecodeRow(tokens[-1], len(ids) + i, blocks)])[0])
    return tokens, np.stack(logits)


def prefill(runner: ModelRunner, ids: list[int], blocks: list[int]) -> np.ndarray:
    chunk = runner.shapes.prefill_chunk
    for start in range(0, len(ids), chunk):
        logits, _ = runner.prefill([PrefillChunk(ids[start:start + chunk], start, blocks)])
    return logits[0]
