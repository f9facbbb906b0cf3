"""Next-token choice: a chain of small logits processors plus a per-request seeded RNG.

Processors follow HF/TGI semantics (repetition penalty, temperature, top-k, top-p,
typical-p, Kirchenbauer et al. green-list watermark). All maths is float64 NumPy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from backends.types import SamplingParams

# (logits [V] float64, history ids [N] int64) -> logits [V]. May edit ``logits`` in place:
# NextTokenChooser hands each chain its own float64 copy.
Processor = Callable[[np.ndarray, np.ndarray], np.ndarray]

WATERMARK_GAMMA = 0.5  # share of the vocabulary on the green list
WATERMARK_DELTA = 2.0  # logit bonus of green tokens
WATERMARK_HASH_KEY = 15485863  # a large prime, as in TGI and the paper's code
_FIRST_WINDOW = 64  # nucleus search looks at this many best candidates first, then widens


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - math.log(np.exp(shifted).sum())


@dataclass(frozen=True, slots=True)
class RepetitionPenalty:
    """Tokens already in the history: logit > 0 is divided by ``penalty``, else multiplied."""

    penalty: float

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        if history.size:
            ids = np.unique(history)
            seen = logits[ids]
            logits[ids] = np.where(seen > 0, seen / self.penalty, seen * self.penalty)
        return logits


@dataclass(frozen=True, slots=True)
class Temperature:
    temperature: float

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        logits /= self.temperature
        return logits


@dataclass(frozen=True, slots=True)
class TopK:
    """Keep the k highest logits (and any tied with the k-th, as HF does)."""

    k: int

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        cut = logits.size - self.k
        if cut <= 0:
            return logits
        kth = np.partition(logits, cut)[cut]
        logits[logits < kth] = -np.inf
        return logits


@dataclass(frozen=True, slots=True)
class TopP:
    """Nucleus: the most likely tokens until their mass reaches ``p`` (at least one)."""

    p: float

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        probs = np.exp(log_softmax(logits))
        return _keep_only(logits, _smallest_mass_prefix(-logits, probs, self.p))


@dataclass(frozen=True, slots=True)
class TypicalP:
    """Typical decoding (Meister et al.): tokens whose surprisal is closest to the entropy."""

    mass: float

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        logp = log_softmax(logits)
        probs = np.exp(logp)
        alive = probs > 0
        entropy = -np.dot(probs[alive], logp[alive])
        distance = np.abs(-logp - entropy)  # filtered tokens: inf, so they come last
        keep = _smallest_mass_prefix(distance, probs, self.mass)
        # as HF: every token tied with the last kept one stays too
        return _keep_only(logits, np.flatnonzero(distance <= distance[keep].max()))


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

    ``vocab_size`` must be the logits width the generator used (padded vocab included).
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


def build_processors(params: SamplingParams) -> list[Processor]:
    """The chain for one request; neutral values add nothing. Greedy skips the warpers."""
    chain: list[Processor] = []
    if params.watermark:
        chain.append(Watermark())
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(params.repetition_penalty))
    if not params.do_sample:
        return chain
    if params.temperature != 1.0:
        chain.append(Temperature(params.temperature))
    if params.top_k > 0:
        chain.append(TopK(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopP(params.top_p))
    if params.typical_p < 1.0:
        chain.append(TypicalP(params.typical_p))
    return chain


class NextTokenChooser:
    """One request's sampler: its processor chain and its own RNG seeded by ``params.seed``."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.processors = build_processors(params)
        self.rng = np.random.Generator(np.random.PCG64(params.seed))

    def choose(self, logits: np.ndarray, history_ids: Sequence[int] | np.ndarray) -> tuple[int, float]:
        """Pick the next id from ``logits`` [V]; ``history_ids`` = prompt + generated ids.

        Returns (id, log-probability of id under the final processed distribution).
        """
        scores = np.asarray(logits).astype(np.float64)  # always a fresh copy
        history = np.asarray(history_ids, dtype=np.int64)
        for process in self.processors:
            scores = process(scores, history)
        logp = log_softmax(scores)
        token = _sample(logp, self.rng) if self.params.do_sample else int(np.argmax(scores))
        return token, float(logp[token])


def choose_batch(
    logits: np.ndarray,
    choosers: Sequence[NextTokenChooser],
    histories: Sequence[Sequence[int] | np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """Row b of ``logits`` [B, V] goes to ``choosers[b]``; rows never influence each other.

    Returns ids [B] int64 and logprobs [B] float64.
    """
    if not (len(logits) == len(choosers) == len(histories)):
        raise ValueError(f"batch mismatch: {len(logits)} rows, {len(choosers)} choosers, {len(histories)} histories")
    picks = [c.choose(row, h) for row, c, h in zip(logits, choosers, histories)]
    ids = np.array([p[0] for p in picks], dtype=np.int64)
    logprobs = np.array([p[1] for p in picks], dtype=np.float64)
    return ids, logprobs


def _sample(logp: np.ndarray, rng: np.random.Generator) -> int:
    # Inverse CDF with one uniform draw: one RNG step per token, whatever the vocab size.
    probs = np.exp(logp)
    cdf = np.cumsum(probs)
    token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if token == cdf.size:  # the draw rounded up to the total: take the last live token
        token = int(np.flatnonzero(probs)[-1])
    return token


def _smallest_mass_prefix(key: np.ndarray, probs: np.ndarray, mass: float) -> np.ndarray:
    """Ids in ascending ``key`` order, kept while the mass before them is < ``mass``.

    Sorting only a window of the best candidates (widened until it holds ``mass``)
    avoids a full-vocabulary sort in the common, peaked case.
    """
    size = key.size
    width = min(size, _FIRST_WINDOW)
    while True:
        cand = np.argpartition(key, width - 1)[:width] if width < size else np.arange(size)
        cand = cand[np.lexsort((cand, key[cand]))]  # by key, ties by id
        cdf = np.cumsum(probs[cand])
        if cdf[-1] >= mass or width == size:
            break
        width = min(size, width * 8)
    return cand[: 1 + int(np.searchsorted(cdf, mass, side="left"))]


def _keep_only(logits: np.ndarray, keep: np.ndarray) -> np.ndarray:
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out
