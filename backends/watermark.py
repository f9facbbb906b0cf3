"""The Kirchenbauer et al. green-list watermark, as TGI applies it (a logits processor of backends/sampling.py's
chain) and its detector's z-score."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

WATERMARK_GAMMA = 0.5  # share of the vocabulary on the green list
WATERMARK_DELTA = 2.0  # logit bonus of green tokens
WATERMARK_HASH_KEY = 15485863  # a large prime, as in TGI and the paper's code


@dataclass(frozen=True, slots=True)
class Watermark:
    """Add ``delta`` to the green list drawn from the previous token (TGI's processor)."""

    gamma: float = WATERMARK_GAMMA
    delta: float = WATERMARK_DELTA
    hash_key: int = WATERMARK_HASH_KEY

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        if history.size:
            logits[green_list(int(history[-1]), logits.size, self.gamma, self.hash_key)] += self.delta
        return logits


def green_list(
    prev_token: int,
    vocab_size: int,
    gamma: float = WATERMARK_GAMMA,
    hash_key: int = WATERMARK_HASH_KEY,
) -> np.ndarray:
    """The green token ids after ``prev_token``: a fixed function of (prev_token, vocab_size)."""
    rng = np.random.Generator(np.random.PCG64(hash_key * prev_token))
    return rng.permutation(vocab_size)[: int(vocab_size * gamma)]


def watermark_z_score(
    token_ids: Sequence[int],
    vocab_size: int,
    gamma: float = WATERMARK_GAMMA,
    hash_key: int = WATERMARK_HASH_KEY,
) -> float:
    """Detector: z-score of the green-token count; ``token_ids[0]`` is context only.

    ``vocab_size`` must be the width the chooser sampled over (its ``vocab_size``, else
    the logits width).
    """
    ids = [int(t) for t in token_ids]
    scored = len(ids) - 1
    if scored < 1:
        return 0.0
    hits = sum(
        bool(np.any(green_list(prev, vocab_size, gamma, hash_key) == tok))
        for prev, tok in zip(ids, ids[1:])
    )
    return (hits - gamma * scored) / math.sqrt(scored * gamma * (1.0 - gamma))
