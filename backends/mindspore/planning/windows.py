"""How many blocks a sliding-window layer (Gemma 3's local layers) needs of one sequence: the sizing rule of the
window pool (``engine/window_pool.py``), shared with the memory budget (``memory.py``). No MindSpore import."""
from __future__ import annotations

from backends.settings import EngineConfig


def live_blocks(window: int, block_size: int, row_tokens: int) -> int:
    """The most blocks of one sequence a sliding-window layer reads or writes in one step: the keys
    [s - window + 1, s + row_tokens - 1] of a step computing up to ``row_tokens`` positions from s, wherever s
    falls in a block."""
    span = window - 1 + row_tokens
    return (span + block_size - 2) // block_size + 1


def row_tokens(config: EngineConfig) -> int:
    """The most positions one sequence computes in a step: a prompt chunk, or a decode token with its drafts
    (which stay within the largest batch: ``PackedRunner.draft_budget``)."""
    return max(config.prefill_chunk, config.max_batch_size, 1)


def window_blocks(window: int, config: EngineConfig, longest: int) -> int:
    """Blocks a sequence of the ``longest`` length reserves in the window pool; 0 when the window covers it (a
    pool would save nothing)."""
    per_sequence = -(-longest // config.block_size)
    live = live_blocks(window, config.block_size, row_tokens(config))
    return live if live < per_sequence else 0
