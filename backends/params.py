"""Resolve a request's sampling parameters with the MindSpore ("ms") default rules.

As docs/api.md's parameters table of POST / states: unset → yaml ``model.model_config`` value → built-in
fallback (``backends.defaults``); sampling is switched on by any request-set warper; top_k is clamped to
the vocabulary size (None = off).
"""
from __future__ import annotations

import random
from typing import Protocol

from backends.defaults import FALLBACKS
from backends.types import ModelDefaults, RequestParams, SamplingParams

# Setting any of these in the request (with do_sample unset) turns sampling on.
SAMPLING_TRIGGERS = ("temperature", "top_k", "top_p", "typical_p")
SEED_MAX = 2**64 - 1


class SeedSource(Protocol):
    def randint(self, a: int, b: int) -> int: ...


def resolve(
    req: RequestParams,
    defaults: ModelDefaults,
    vocab_size: int,
    rng_seed_source: SeedSource | None = None,
) -> SamplingParams:
    """Turn client parameters (None = unset) into concrete sampling parameters."""
    if req.do_sample is not None:
        do_sample = req.do_sample
    elif any(getattr(req, name) is not None for name in SAMPLING_TRIGGERS):
        do_sample = True
    else:
        do_sample = bool(_default(defaults, "do_sample"))
    top_k = _pick(req, defaults, "top_k")
    return SamplingParams(
        do_sample=do_sample,
        temperature=float(_pick(req, defaults, "temperature")),
        top_k=None if top_k is None else min(int(top_k), vocab_size),
        top_p=float(_pick(req, defaults, "top_p")),
        typical_p=float(_pick(req, defaults, "typical_p")),
        repetition_penalty=float(_pick(req, defaults, "repetition_penalty")),
        watermark=req.watermark,
        seed=req.seed if req.seed is not None else draw_seed(rng_seed_source),
    )


def draw_seed(source: SeedSource | None = None) -> int:
    """A fresh uint64 seed in [1, 2**64 - 1] (OS entropy unless a source is given)."""
    source = source if source is not None else random.SystemRandom()
    return source.randint(1, SEED_MAX)


def effective_max_new_tokens(
    max_new_tokens: int, max_iter_times: int, max_seq_len: int, prompt_len: int
) -> int:
    """The generation cap: min(requested, maxIterTimes, room left in maxSeqLen)."""
    return min(max_new_tokens, max_iter_times, max_seq_len - prompt_len)


def _pick(req: RequestParams, defaults: ModelDefaults, name: str) -> float | int | bool | None:
    value = getattr(req, name)
    return value if value is not None else _default(defaults, name)


def _default(defaults: ModelDefaults, name: str) -> float | int | bool | None:
    value = getattr(defaults, name, None)  # the yaml has no typical_p
    return value if value is not None else FALLBACKS[name]
