"""Next-token choice: a request's chain of logits processors (backends/logit_processors.py) plus its own seeded RNG;
for greedy, top-k and nucleus requests, a choice from one scan of the row (``RowScan``) where it gives the same
bits. All maths is float64 NumPy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from backends.logit_processors import (SPARSE, Processor, Temperature, TopK, TopP, TypicalP, build_processors,
                                       log_softmax, log_sum_exp)
from backends.types import SamplingParams


@dataclass(frozen=True, slots=True)
class RowScan:
    """What one pass over a logits row tells a chooser: its argmax (first index of the largest value), its
    log-sum-exp, and its k best ids with their values, best first (value descending, then id ascending)."""

    argmax: int
    lse: float
    best_ids: np.ndarray  # [<= k] int64
    best_vals: np.ndarray  # [<= k] float64: the row's values, widened


# (row [V], k) -> RowScan, or None where it cannot (a row it does not take, k past its limit). The engine picks
# one at start-up (the kernel library's, kernels/vocab.py); a chooser without one uses NumPy on whole rows.
RowScanner = Callable[[np.ndarray, int], "RowScan | None"]

_CDF_BLOCK = 1024
_NUCLEUS_BEST = (64, 256)  # the best lists a nucleus is looked for in, in turn (kernels/vocab.py MAX_BEST: 256)
_SPARSE_BEST = 256  # the most best ids a sparse greedy choice asks the scan for
_SPARSE_SHORT = 8  # its first try: the best untouched it needs + this many (a long list costs the scan time)


def vocab_log_softmax(logits: np.ndarray, vocab_size: int | None) -> np.ndarray:
    """Each row of ``logits`` [N, V'] as float64 logprobs over the first ``vocab_size`` ids, the set the
    chooser samples from (``NextTokenChooser.vocab_size``): padded embedding rows carry no mass."""
    rows = np.asarray(logits)[:, :vocab_size].astype(np.float64)
    return np.stack([log_softmax(row) for row in rows]) if len(rows) else rows


class NextTokenChooser:
    """One request's sampler: its processor chain and its own RNG seeded by ``params.seed``.

    ``first`` processors (logit_bias, the EOS ban) run before the sampling chain; a step's grammar mask
    (``allowed``) before them all, so every later processor sees only the tokens the grammar allows.
    """

    def __init__(self, params: SamplingParams, vocab_size: int | None = None,
                 first: Sequence[Processor] = (), scan: RowScanner | None = None) -> None:
        self.params = params
        self.vocab_size = vocab_size  # logits past it (padded vocab rows) are never chosen
        self.processors = [*first, *build_processors(params)]
        self.rng = np.random.Generator(np.random.PCG64(params.seed))
        self.scan = scan
        # A sampling chain of only temperature, top-k and the nucleus warpers (top-k among them) is decided by the
        # row's best k + 1: chosen from them alone when the (k+1)-th is not tied with the k-th (_choose_best_k).
        warpers = all(isinstance(p, (Temperature, TopK, TopP, TypicalP)) for p in self.processors)
        top_k = [p.k for p in self.processors if isinstance(p, TopK)]
        self.best_k = top_k[0] + 1 if params.do_sample and warpers and len(top_k) == 1 else 0
        # Nucleus sampling alone (top_p, nothing else): decided by the row's best tokens until their mass reaches p,
        # which the scan's best list and log-sum-exp give (_choose_nucleus).
        self.nucleus = params.do_sample and [type(p) for p in self.processors] == [TopP]
        # Greedy with only processors that change a few tokens (a penalty, a logit bias, the EOS ban).
        self.sparse = not params.do_sample and bool(self.processors) and \
            all(isinstance(p, SPARSE) for p in self.processors)

    def choose(self, logits: np.ndarray, history_ids: Sequence[int] | np.ndarray,
               allowed: np.ndarray | None = None) -> tuple[int, float]:
        """Pick the next id from ``logits`` [V]; ``history_ids`` = prompt + generated ids; ``allowed``:
        bool [V], the grammar's mask (None: any token).

        Returns (id, log-probability of id under the final processed distribution).
        """
        token, logprob, _ = self.choose_with_top(logits, history_ids, allowed)
        return token, logprob

    def choose_with_top(self, logits: np.ndarray, history_ids: Sequence[int] | np.ndarray,
                        allowed: np.ndarray | None = None, top: int = 0
                        ) -> tuple[int, float, tuple[tuple[int, float], ...]]:
        """``choose``, plus the ``top`` most likely (id, logprob) under the same distribution, best first
        (ties by id; fewer if fewer tokens are possible)."""
        if allowed is None and self.scan is not None:
            chosen = self._choose_scanned(np.asarray(logits)[: self.vocab_size], history_ids, top)
            if chosen is not None:
                return chosen
        if allowed is None and not self.processors and not self.params.do_sample and top <= 0:
            return _plain_greedy(np.asarray(logits)[: self.vocab_size])
        scores = np.asarray(logits)[: self.vocab_size].astype(np.float64)  # always a fresh copy
        if allowed is not None:
            scores[~allowed[: scores.size]] = -np.inf
        history = np.asarray(history_ids, dtype=np.int64)
        for process in self.processors:
            scores = process(scores, history)
        token = _sample(scores, self.rng) if self.params.do_sample else int(np.argmax(scores))
        norm = log_sum_exp(scores)
        return token, float(scores[token] - norm), _top(scores, norm, top)

    def _choose_scanned(self, row: np.ndarray, history, top: int) -> tuple[int, float, tuple] | None:
        """``choose_with_top`` from one ``scan`` of the row, without a copy or a sort of it: a greedy chooser with
        nothing to apply or only a few tokens' edits (``sparse``), a top-k sampling chain (``best_k``), nucleus
        sampling alone (``nucleus``); None where the scan cannot say (the general path then runs, with the same
        result)."""
        if not self.processors and not self.params.do_sample:
            scan = self.scan(row, max(top, 0))
            if scan is None:
                return None
            alternatives = tuple((int(i), float(v - scan.lse)) for i, v in zip(scan.best_ids, scan.best_vals)
                                 if v > -np.inf)
            return scan.argmax, float(row[scan.argmax]) - scan.lse, alternatives
        if self.best_k:
            return self._choose_best_k(row, top)
        if self.nucleus:
            return self._choose_nucleus(row, top)
        return self._choose_greedy_sparse(row, history, top) if self.sparse else None

    def _choose_best_k(self, row: np.ndarray, top: int) -> tuple[int, float, tuple] | None:
        """The sampling chain on the row's best k + 1 only, in id order (the order the whole row has), so every
        processor, the draw and the logprob compute what they would on the whole row, whose other tokens the
        top-k leaves at -inf: unless the chain's top-k keeps the (k+1)-th (a tie at the k-th value), when tokens
        outside these may be tied too (None: the whole row is needed)."""
        scan = self.scan(row, self.best_k)
        if scan is None:
            return None
        order = np.argsort(scan.best_ids, kind="stable")
        ids, scores = scan.best_ids[order], scan.best_vals[order]  # a fresh float64 array
        last = order.argsort()[-1] if ids.size == self.best_k else None  # where the (k+1)-th best went
        history = np.empty(0, np.int64)  # no processor of such a chain reads it
        for process in self.processors:
            scores = process(scores, history)
            if isinstance(process, TopK) and last is not None and scores[last] > -np.inf:
                return None
        token = _sample(scores, self.rng)
        norm = log_sum_exp(scores)
        alternatives = tuple((int(ids[i]), lp) for i, lp in _top(scores, norm, top))
        return int(ids[token]), float(scores[token] - norm), alternatives

    def _choose_nucleus(self, row: np.ndarray, top: int) -> tuple[int, float, tuple] | None:
        """TopP alone from the row's best tokens: the nucleus is the shortest prefix of the row's order (value
        descending, ids ascending) whose mass (each exp(value - log-sum-exp)) reaches p, as TopP cuts it; when the
        scan's best list holds it, the draw and the logprobs run on the nucleus in id order, as ``_choose_best_k``.
        None when the best list does not reach p (a flat row: the whole row is needed)."""
        p = self.processors[0].p
        for k, wider in zip(_NUCLEUS_BEST, (*_NUCLEUS_BEST[1:], 0)):
            scan = self.scan(row, k)
            if scan is None or not math.isfinite(scan.lse):
                return None
            probs = np.exp(scan.best_vals - scan.lse)
            cdf = np.cumsum(probs)
            n = 1 + int(np.searchsorted(cdf, p, side="left"))
            if n <= scan.best_ids.size:
                break
            # the next list's extra tokens weigh at most this list's last each: go on only if they could reach p
            if scan.best_ids.size < k or cdf[-1] + (wider - k) * probs[-1] < p:
                return None
        else:
            return None
        order = np.argsort(scan.best_ids[:n], kind="stable")
        ids, scores = scan.best_ids[:n][order], scan.best_vals[:n][order]
        token = _sample(scores, self.rng)
        norm = log_sum_exp(scores)
        alternatives = tuple((int(ids[i]), lp) for i, lp in _top(scores, norm, top))
        return int(ids[token]), float(scores[token] - norm), alternatives

    def _choose_greedy_sparse(self, row: np.ndarray, history_ids, top: int) -> tuple[int, float, tuple] | None:
        """Greedy with only ``SPARSE`` processors: their tokens' values edited alone (``on_touched``), the rest of
        the row from one scan: its best untouched tokens, and the log-sum-exp with the touched tokens' mass taken
        out and their edited mass put in. None (the whole row) when the touched tokens are too many for the scan's
        best list, or held more than half the row's mass (the difference would lose digits)."""
        history = np.asarray(history_ids, dtype=np.int64)
        ids = np.unique(np.concatenate([p.touched(history) for p in self.processors]))
        ids = ids[(ids >= 0) & (ids < row.size)]
        need = max(top, 1)  # the best untouched tokens wanted: a short best list holds them unless the touched crowd it
        for want in (need + _SPARSE_SHORT, ids.size + need):
            if want > _SPARSE_BEST or want > row.size:
                return None
            scan = self.scan(row, want)
            if scan is None or not math.isfinite(scan.lse):
                return None
            rest = ~np.isin(scan.best_ids, ids)
            if rest.sum() >= need:
                break
        raw = row[ids].astype(np.float64)
        removed = float(np.exp(raw - scan.lse).sum())
        if removed > 0.5:
            return None
        rest_ids, rest_vals = scan.best_ids[rest], scan.best_vals[rest]  # best first
        vals = raw.copy()
        for process in self.processors:
            process.on_touched(vals, ids, row.size, history, bool(rest_vals[0] > -np.inf))
        norm = _with_edited(scan.lse + math.log1p(-removed), vals)
        cand_ids = np.concatenate([rest_ids[: max(top, 1)], ids])
        cand_vals = np.concatenate([rest_vals[: max(top, 1)], vals])
        order = np.lexsort((cand_ids, -cand_vals))
        token = int(cand_ids[order[0]])
        alternatives = tuple((int(cand_ids[i]), float(cand_vals[i] - norm)) for i in order[:max(top, 0)]
                             if cand_vals[i] > -np.inf)
        return token, float(cand_vals[order[0]] - norm), alternatives


def _plain_greedy(logits: np.ndarray) -> tuple[int, float, tuple]:
    """``choose_with_top`` of a greedy chooser with nothing to apply (no processor, no mask, no top list),
    without its float64 copy of the row: the same bits, since argmax and max agree on a row and its exact
    float64 widening, and the widening is done inside the one subtraction ``log_sum_exp`` makes anyway."""
    token = int(np.argmax(logits))
    best = float(logits[token])  # the row's max, as log_sum_exp's ``top``
    shifted = np.subtract(logits, best, dtype=np.float64)
    norm = best + math.log(np.exp(shifted, out=shifted).sum())
    return token, best - norm, ()


def _top(scores: np.ndarray, norm: float, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    k = min(k, scores.size)
    cand = np.argpartition(-scores, k - 1)[:k]
    cand = cand[np.lexsort((cand, -scores[cand]))]
    return tuple((int(i), float(scores[i] - norm)) for i in cand if scores[i] > -np.inf)


def choose_batch(
    logits: np.ndarray,
    choosers: Sequence[NextTokenChooser],
    histories: Sequence[Sequence[int] | np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """Row b of ``logits`` [B, V] goes to ``choosers[b]``; rows never influence each other.

    Returns ids [B] int64 and logprobs [B] float64.
    """
    if not (len(logits) == len(choosers) == len(histories)):
        raise ValueError(
            f"batch mismatch: {len(logits)} rows, {len(choosers)} choosers, {len(histories)} histories"
        )
    picks = [c.choose(row, h) for row, c, h in zip(logits, choosers, histories)]
    ids = np.array([p[0] for p in picks], dtype=np.int64)
    logprobs = np.array([p[1] for p in picks], dtype=np.float64)
    return ids, logprobs


def _sample(scores: np.ndarray, rng: np.random.Generator) -> int:
    # Inverse CDF with one uniform draw: one RNG step per token, whatever the vocab size.
    live = np.flatnonzero(scores > -np.inf)
    weights = scores[live]
    weights -= weights.max()
    return int(live[_inverse_cdf(np.exp(weights, out=weights), rng.random())])


def _inverse_cdf(probs: np.ndarray, u: float) -> int:
    """First i with cumsum(probs)[i] > u * sum(probs); two-level, as a full cumsum is slow."""
    starts = np.arange(0, probs.size, _CDF_BLOCK)
    block_cdf = np.cumsum(np.add.reduceat(probs, starts))
    target = u * block_cdf[-1]
    block = int(np.searchsorted(block_cdf, target, side="right"))
    if block == starts.size:  # the draw rounded up to the total: the last live token
        return int(np.flatnonzero(probs)[-1])
    if block:
        target -= block_cdf[block - 1]
    inner = probs[starts[block] : starts[block] + _CDF_BLOCK]  # this block's mass is > 0
    index = int(np.searchsorted(np.cumsum(inner), target, side="right"))
    if index == inner.size:  # rounding pushed the draw past the block's own sum
        index = int(np.flatnonzero(inner)[-1])
    return int(starts[block]) + index


def _with_edited(kept: float, vals: np.ndarray) -> float:
    """log(exp(kept) + sum(exp(vals))): the untouched tokens' log-mass and the touched tokens' edited values, each
    log-sum-exp taken from its own maximum (a tiny repetition penalty multiplies a value far past exp's range)."""
    peak = float(vals.max()) if vals.size else -math.inf
    if peak == -math.inf:
        return kept
    return float(np.logaddexp(kept, peak + math.log(float(np.exp(vals - peak).sum()))))
