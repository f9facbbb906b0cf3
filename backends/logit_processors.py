"""The logits processors a request's chooser chains (backends/sampling.py): HF/TGI semantics for the repetition
penalty, temperature, top-k, top-p and typical-p, plus the request's logit bias and EOS ban. All maths is float64
NumPy. ``SPARSE`` processors also say which few tokens they touch (``touched``) and edit those alone
(``on_touched``), so a greedy chooser can apply them without a whole-row copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from backends.types import SamplingParams
from backends.watermark import Watermark

# (logits [V] float64, history ids [N] int64) -> logits [V]. May edit ``logits`` in place:
# NextTokenChooser hands each chain its own float64 copy.
Processor = Callable[[np.ndarray, np.ndarray], np.ndarray]


def log_sum_exp(logits: np.ndarray) -> float:
    top = float(logits.max())
    shifted = logits - top
    return top + math.log(np.exp(shifted, out=shifted).sum())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    return logits - log_sum_exp(logits)


# Nucleus candidate windows, in nats from the best key (see _smallest_mass_prefix).
_KEY_WINDOWS = (1.0, 2.0, 4.0, 6.0, 9.0, 12.0, 16.0, 24.0, np.inf)


@dataclass(frozen=True, slots=True)
class RepetitionPenalty:
    """Tokens already in the history: logit > 0 is divided by ``penalty``, else multiplied. A result past the
    dtype's range stays at its most negative (or, for a tiny penalty, most positive) finite value: the token is
    as unlikely (likely) as a logit can say, and the row still has a distribution."""

    penalty: float

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        if history.size:
            ids = np.unique(history)
            logits[ids] = self.penalised(logits[ids])
        return logits

    def penalised(self, seen: np.ndarray) -> np.ndarray:
        """``seen`` (a fresh array of the history's logits) with the penalty applied, in place."""
        positive = seen > 0
        finfo = np.finfo(seen.dtype)
        with np.errstate(over="ignore", divide="ignore"):
            lowered = np.maximum(seen[~positive] * np.float64(self.penalty), finfo.min)  # float32: 1e-323 is 0
            seen[positive] = np.minimum(seen[positive] / np.float64(self.penalty), finfo.max)
        seen[~positive] = lowered
        return seen

    def touched(self, history: np.ndarray) -> np.ndarray:
        return history

    def on_touched(self, vals: np.ndarray, ids: np.ndarray, size: int, history: np.ndarray, rest_finite: bool) -> None:
        if history.size:
            at = _positions(ids, np.unique(history))
            vals[at] = self.penalised(vals[at])


@dataclass(frozen=True, slots=True)
class Temperature:
    """Logits divided by ``temperature``; a quotient past the dtype's range stays at its largest finite value
    (after a tiny repetition penalty, a logit may already be near it)."""

    temperature: float

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        finite = np.isfinite(logits)
        with np.errstate(over="ignore"):
            logits /= self.temperature
        overflowed = finite & ~np.isfinite(logits)
        if overflowed.any():
            finfo = np.finfo(logits.dtype)
            logits[overflowed] = np.where(logits[overflowed] > 0, finfo.max, finfo.min)
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
        live = np.flatnonzero(logits > -np.inf)
        scores = logits[live]
        probs = np.exp(log_softmax(scores))
        return _keep_only(logits, live[_smallest_mass_prefix(-scores, probs, self.p)])


@dataclass(frozen=True, slots=True)
class TypicalP:
    """Typical decoding (Meister et al.): tokens whose surprisal is closest to the entropy."""

    mass: float

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        live = np.flatnonzero(logits > -np.inf)
        logp = log_softmax(logits[live])
        probs = np.exp(logp)
        entropy = -np.dot(probs, logp)
        distance = np.abs(-logp - entropy)  # |surprisal - expected surprisal|
        keep = _smallest_mass_prefix(distance, probs, self.mass)
        # as HF: every token tied with the last kept one stays too
        return _keep_only(logits, live[distance <= distance[keep].max()])


@dataclass(frozen=True, slots=True)
class LogitBias:
    """OpenAI's logit_bias: add each bias to its token's logit (+100 all but forces it, -100 bans it)."""

    ids: np.ndarray  # [K] int64
    biases: np.ndarray  # [K] float64

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        live = self.ids < logits.size
        np.add.at(logits, self.ids[live], self.biases[live])
        return logits

    def touched(self, history: np.ndarray) -> np.ndarray:
        return self.ids

    def on_touched(self, vals: np.ndarray, ids: np.ndarray, size: int, history: np.ndarray, rest_finite: bool) -> None:
        live = self.ids < size
        np.add.at(vals, _positions(ids, self.ids[live]), self.biases[live])


@dataclass(frozen=True, slots=True)
class SuppressEos:
    """No EOS while the sequence is shorter than ``until`` tokens (prompt included): min_tokens and
    ignore_eos. EOS stays when nothing else is possible (a finished grammar allows only EOS)."""

    eos_ids: np.ndarray  # [E] int64
    until: int

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        if history.size >= self.until:
            return logits
        eos = self.eos_ids[self.eos_ids < logits.size]
        kept = logits[eos].copy()
        logits[eos] = -np.inf
        if not np.isfinite(logits).any():  # EOS was the only choice left
            logits[eos] = kept
        return logits

    def touched(self, history: np.ndarray) -> np.ndarray:
        return self.eos_ids

    def on_touched(self, vals: np.ndarray, ids: np.ndarray, size: int, history: np.ndarray, rest_finite: bool) -> None:
        if history.size >= self.until:
            return
        at = _positions(ids, self.eos_ids[self.eos_ids < size])
        kept = vals[at].copy()
        vals[at] = -np.inf
        if not rest_finite and not np.isfinite(vals).any():  # EOS was the only choice left
            vals[at] = kept


# The processors that change only a few tokens of a row (``touched(history)`` says which); ``on_touched`` applies the
# same float64 operations to those tokens' values alone (``ids`` ascending, holding every token it touches; ``size``
# the row's; ``rest_finite``: whether any other token of the row is finite), so a greedy chooser with only these
# takes the rest of the row from one scan (NextTokenChooser._choose_greedy_sparse).
SPARSE = (RepetitionPenalty, LogitBias, SuppressEos)


def _positions(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Where each of ``wanted`` (all present) sits in ascending ``ids``."""
    return np.searchsorted(ids, wanted)


def request_processors(logit_bias: Sequence[tuple[int, float]], eos_ids: Sequence[int],
                       eos_banned_until: int) -> list[Processor]:
    """The per-request processors that come before the sampling chain (neutral values add none)."""
    chain: list[Processor] = []
    if logit_bias:
        chain.append(LogitBias(np.array([i for i, _ in logit_bias], dtype=np.int64),
                               np.array([b for _, b in logit_bias], dtype=np.float64)))
    if eos_banned_until > 0 and eos_ids:
        chain.append(SuppressEos(np.array(sorted(eos_ids), dtype=np.int64), eos_banned_until))
    return chain


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
    if params.top_k is not None:
        chain.append(TopK(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopP(params.top_p))
    if params.typical_p < 1.0:
        chain.append(TypicalP(params.typical_p))
    return chain


def _smallest_mass_prefix(key: np.ndarray, probs: np.ndarray, mass: float) -> np.ndarray:
    """Positions in ascending ``key`` order (ties by position), kept while the mass
    before them is < ``mass``; at least one.

    Only keys within a window of the best are sorted, widened until the window holds
    ``mass``: every token outside it sorts after every token inside.
    """
    best = key.min()
    for width in _KEY_WINDOWS:
        cand = np.flatnonzero(key <= best + width)
        if probs[cand].sum() >= mass:
            break
    cand = cand[np.argsort(key[cand], kind="stable")]
    cdf = np.cumsum(probs[cand])
    return cand[: 1 + int(np.searchsorted(cdf, mass, side="left"))]


def _keep_only(logits: np.ndarray, keep: np.ndarray) -> np.ndarray:
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out
