"""The static shapes the graphs are compiled for, derived from the engine settings: the one home of the
bucket rules (batch and window coverage; the cache size is ``memory.py``'s). No MindSpore import:
``service/`` asks these same functions.
"""
from __future__ import annotations

from dataclasses import dataclass

from backends.limits import longest_sequence
from backends.settings import EngineConfig


class ShapeError(ValueError):
    """The buckets do not cover what the settings ask for; ``key`` is the ScheduleConfig key at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key} {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class Shapes:
    """The static shapes the graphs are compiled for (buckets ascending, windows multiples of block_size)."""

    block_size: int
    prefill_chunk: int
    batch_buckets: tuple[int, ...]  # decode batch sizes
    window_buckets: tuple[int, ...]  # attention windows (tokens)
    prefill_batch_buckets: tuple[int, ...] = (1,)  # sequences prefilled together
    prefill_sizes: tuple[int, ...] = ()  # packed steps: token counts compiled (default: the chunk)

    @property
    def max_window(self) -> int:
        return self.window_buckets[-1]

    def window_for(self, tokens: int) -> int:
        for w in self.window_buckets:
            if w >= tokens:
                return w
        raise ValueError(f"{tokens} tokens exceed the largest attention window {self.max_window}")

    def batch_for(self, rows: int, prefill: bool = False) -> int:
        buckets = self.prefill_batch_buckets if prefill else self.batch_buckets
        for b in buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest batch {buckets[-1]}")


def check_buckets(config: EngineConfig) -> None:
    """The rules on the configured buckets alone: the largest batch bucket holds maxBatchSize; every
    window is a whole number of cache blocks. Raises ShapeError."""
    batches, windows = config.batch_buckets, config.window_buckets
    if batches and max(batches) < config.max_batch_size:
        raise ShapeError("batchBuckets", f"{sorted(batches)}: the largest must be >= maxBatchSize "
                         f"{config.max_batch_size}")
    odd = [w for w in sorted(windows or ()) if w % config.block_size]
    if odd:
        raise ShapeError("windowBuckets", f"{sorted(windows)}: {odd[0]} is not a multiple of cacheBlockSize "
                         f"{config.block_size}")


def check_window_coverage(config: EngineConfig, max_positions: int | None = None) -> None:
    """The largest window holds the longest sequence, min(maxSeqLen, the model's max_position_embeddings)
    (None: not known yet, maxSeqLen alone). Raises ShapeError."""
    longest = longest_sequence(config, max_positions)
    if config.window_buckets and max(config.window_buckets) < longest:
        model = "" if max_positions is None else f" (the model's max_position_embeddings is {max_positions})"
        raise ShapeError("windowBuckets", f"{sorted(config.window_buckets)}: the largest must be >= {longest}, "
                         f"the longest sequence{model}; raise it or lower maxSeqLen")


def plan_shapes(config: EngineConfig, max_positions: int | None = None) -> Shapes:
    """The shapes for ``config`` (unset buckets derived), checked by ``check_buckets`` and
    ``check_window_coverage``; a runner may narrow them further (see ``ModelRunner.compiled_shapes``)."""
    check_buckets(config)
    check_window_coverage(config, max_positions)
    block = config.block_size
    max_window = -(-longest_sequence(config, max_positions) // block) * block
    return Shapes(block, min(config.prefill_chunk, max_window),
                  tuple(sorted(set(config.batch_buckets or _default_batches(config.max_batch_size)))),
                  tuple(sorted(set(config.window_buckets or _default_windows(max_window, block)))),
                  tuple(sorted(set(config.prefill_batch_buckets or (1, config.max_prefill_batch)))))


def _default_batches(max_batch: int) -> tuple[int, ...]:
    return (*(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch), max_batch)


def _default_windows(max_window: int, block: int) -> tuple[int, ...]:
    sizes, w = [], max(block, 256 // block * block)
    while w < max_window:
        sizes.append(w)
        w *= 4
    return (*sizes, max_window)
