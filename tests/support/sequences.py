"""A bare sequence for the scheduler's pure-logic tests: a prompt of ``prompt`` token ids, ``new`` tokens to
generate, no sampler, stopper or detokenizer."""
from __future__ import annotations

from backends.mindspore.engine.sequence import SeqState


class _Handle:
    cancelled = False


def seq(prompt: int, new: int = 8) -> SeqState:
    return SeqState(handle=_Handle(), prompt_ids=list(range(prompt)), max_new_tokens=new, chooser=None,
                    stopper=None, detokenizer=None, seed=1)
