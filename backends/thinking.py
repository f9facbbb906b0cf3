"""``thinking_budget``: at most that many generated tokens inside the reasoning block; then its closing
marker is forced and the model goes on with its answer. A processor of the sampling chain, stateless: it
reads the block's state from the token history."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from backends.chat_format import THINK
from backends.errors import ParameterRejected


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    start: int  # the prompt's length: generated tokens follow
    open_id: int
    close_id: int
    budget: int
    opened: bool  # the prompt left the block open: generation starts inside it

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        generated = np.asarray(history)[self.start:]
        begin = 0
        if not self.opened:
            hits = np.flatnonzero(generated == self.open_id)
            if hits.size == 0:
                return logits
            begin = int(hits[0]) + 1
        inside = generated[begin:]
        if inside.size < self.budget or (inside == self.close_id).any():
            return logits
        kept = logits[self.close_id]
        if not np.isfinite(kept):  # the grammar does not allow the block to close here
            return logits
        logits[:] = -np.inf
        logits[self.close_id] = kept
        return logits


def thinking_budget(budget: int | None, prompt_ids: Sequence[int],
                    token_id: Callable[[str], int | None]) -> list[ThinkingBudget]:
    """The processor for ``budget`` (none when unset); ``ParameterRejected`` if the model's tokenizer does
    not have the reasoning markers as single tokens."""
    if budget is None:
        return []
    open_id, close_id = token_id(THINK.open), token_id(THINK.close)
    if open_id is None or close_id is None:
        raise ParameterRejected("thinking_budget", f"thinking_budget needs {THINK.open} and {THINK.close} to be "
                                                   "tokens of this model's tokenizer; they are not")
    prompt = list(prompt_ids)
    last_open = max((i for i, t in enumerate(prompt) if t == open_id), default=-1)
    last_close = max((i for i, t in enumerate(prompt) if t == close_id), default=-1)
    return [ThinkingBudget(len(prompt), open_id, close_id, budget, last_open > last_close)]
