"""A random walk through a grammar: the allowed tokens drawn at random (some favoured) until the grammar ends, the
walk draws EOS or ``steps`` tokens are drawn; the tool-grammar tests read what it wrote."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask


def grammar_walk(tokenizer, compiler, grammar, seed: int, *, eos: int, favoured: Collection[int], weight: float,
                 steps: int, must_end: bool = False) -> str:
    """The text of a walk; ``favoured`` tokens ``weight`` times as likely as the others; ``must_end``: an
    AssertionError if ``steps`` tokens went by without the grammar ending or EOS drawn."""
    state, rng, ids = compiler.compile(grammar), np.random.default_rng(seed), []
    favoured = list(favoured)
    for _ in range(steps):
        mask = allocate_token_bitmask(1, tokenizer.vocab_size)
        fill_next_token_bitmask(state.matcher, mask, 0)
        state.bitmask = mask[0]
        allowed = np.flatnonzero(state.allowed())
        weights = np.where(np.isin(allowed, favoured), weight, 1.0)
        token = int(rng.choice(allowed, p=weights / weights.sum()))
        if token == eos:
            break
        state.advance(token)
        ids.append(token)
        if state.matcher.is_stopped():
            break
    else:
        if must_end:
            raise AssertionError("the walk did not end")
    return tokenizer.decode(ids)
