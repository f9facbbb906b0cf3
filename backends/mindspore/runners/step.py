"""One step as the runner reads it: plain rows the scheduler's plan builds from its sequences (vLLM's
``SchedulerOutput`` is the model), and what each row gave. No ``SeqState`` crosses into a runner: an output
names its row by index, and the engine maps it back to the sequence. And how a row's cache blocks become the
graphs' inputs (``token_slots``, ``block_table``: block ``SCRATCH_BLOCK`` is never handed out, padding writes it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCRATCH_BLOCK = 0  # the allocator keeps it back (kv_cache.BlockAllocator); padding tokens write and read it
PREFILL_FIRST = 3  # prefill-only steps in a row while prompts wait (separate prefill and decode calls)


@dataclass(slots=True)
class PrefillChunk:
    ids: list[int]  # this chunk's prompt tokens
    start: int  # position of ids[0]
    blocks: list[int]
    lora: int = -1  # adapter slot (-1: the base model)
    media: tuple[np.ndarray, np.ndarray] | None = None  # vision rows [t, D] and their mask [t]; None: text
    mpos: np.ndarray | None = None  # M-RoPE positions [3, t]; None: cache index + delta on all three
    delta: int = 0
    logit_tokens: int = 1  # the last tokens whose logits are wanted (a decode row's verified drafts: 1 + k)
    local_blocks: list[int] | None = None  # the sliding-window layers' blocks (engine/window_pool.py); None: none


@dataclass(slots=True)
class DecodeRow:
    token: int
    position: int
    blocks: list[int]
    lora: int = -1  # adapter slot (-1: the base model)
    delta: int = 0  # M-RoPE: the token's position is its cache index + delta
    drafts: tuple[int, ...] = ()  # speculative tokens after ``token``, verified in the same forward pass
    local_blocks: list[int] | None = None  # the sliding-window layers' blocks (engine/window_pool.py); None: none

    def chunk(self) -> PrefillChunk:
        """The row as a chunk of 1 + len(drafts) tokens from its position, with the logits of every one."""
        return PrefillChunk([self.token, *self.drafts], self.position, self.blocks, self.lora, delta=self.delta,
                            logit_tokens=1 + len(self.drafts), local_blocks=self.local_blocks)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The rows of one step: row i of the step is ``decode[i]``, then ``prefill[i - len(decode)]``."""

    decode: tuple[DecodeRow, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    def decode_outputs(self) -> list[RowOutput]:
        """An empty output for each decode row, numbered as the step's rows are."""
        return [RowOutput(i, drafts=r.drafts) for i, r in enumerate(self.decode)]

    def prefill_outputs(self) -> list[RowOutput]:
        """An empty output for each prompt chunk, numbered after the decode rows."""
        return [RowOutput(len(self.decode) + i, c) for i, c in enumerate(self.prefill)]


@dataclass(slots=True)
class RowOutput:
    """What one row of a step gave: the logits of its last token, or the error that failed it; a decode row
    with drafts also the logits after each draft token (``verify``)."""

    row: int  # the row's index in the step (StepBatch)
    prompt: PrefillChunk | None = None  # the prompt chunk this row ran; None: a decode row
    logits: np.ndarray | None = None  # [V]
    drafts: tuple[int, ...] = ()  # a decode row's draft tokens
    verify: np.ndarray | None = None  # [len(drafts), V]: row i the logits after draft token i
    hidden: np.ndarray | None = None  # [t, D] final-normed hidden rows of the prompt chunk
    error: Exception | None = None


def token_slots(blocks: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """Flat cache slot of each position of one sequence."""
    table = np.asarray(blocks, dtype=np.int32)
    return table[positions // block_size] * block_size + positions % block_size


def block_table(rows: list[list[int]], width: int) -> np.ndarray:
    """[B, width] table, each row a sequence's blocks padded with the scratch block."""
    out = np.full((len(rows), width), SCRATCH_BLOCK, dtype=np.int32)
    for i, blocks in enumerate(rows):
        n = min(len(blocks), width)
        out[i, :n] = blocks[:n]
    return out
