"""The "ms" backend's default-parameter rules (docs/api.md, the parameters table of POST /) and the effective
max_new_tokens cap."""
import random

import pytest

from backends.params import SEED_MAX, draw_seed, effective_max_new_tokens, resolve
from backends.types import ModelDefaults, RequestParams

NO_YAML = ModelDefaults()
YAML = ModelDefaults(do_sample=False, temperature=0.7, top_k=40, top_p=0.8, repetition_penalty=1.1)
YAML_SAMPLES = ModelDefaults(do_sample=True, top_k=3)
BUILTIN = dict(do_sample=False, temperature=1.0, top_k=None, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)


@pytest.mark.parametrize(
    "req, defaults, expected",
    [
        # nothing set, no yaml values: the built-in fallbacks
        (RequestParams(), NO_YAML, BUILTIN),
        # nothing set: every yaml value is taken; yaml warpers do not switch sampling on
        (RequestParams(), YAML,
         dict(do_sample=False, temperature=0.7, top_k=40, top_p=0.8, repetition_penalty=1.1)),
        (RequestParams(), YAML_SAMPLES, dict(do_sample=True, top_k=3, top_p=1.0, temperature=1.0)),
        # request values win over yaml values
        (RequestParams(top_p=0.5, repetition_penalty=1.3), YAML,
         dict(top_p=0.5, top_k=40, repetition_penalty=1.3)),
        # any request-set warper turns sampling on when do_sample is unset...
        (RequestParams(temperature=0.5), YAML, dict(do_sample=True, temperature=0.5, top_k=40)),
        (RequestParams(top_k=5), NO_YAML, dict(do_sample=True, top_k=5, temperature=1.0)),
        (RequestParams(top_p=0.9), NO_YAML, dict(do_sample=True, top_p=0.9)),
        (RequestParams(typical_p=0.3), NO_YAML, dict(do_sample=True, typical_p=0.3)),
        (RequestParams(temperature=1.0), NO_YAML, dict(do_sample=True, temperature=1.0)),
        # ...but not repetition_penalty nor watermark
        (RequestParams(repetition_penalty=1.5), NO_YAML, dict(do_sample=False, repetition_penalty=1.5)),
        (RequestParams(watermark=True), NO_YAML, dict(do_sample=False, watermark=True)),
        (RequestParams(repetition_penalty=1.5), YAML_SAMPLES, dict(do_sample=True, repetition_penalty=1.5)),
        # an explicit do_sample always wins
        (RequestParams(do_sample=False, temperature=0.5, top_k=3), NO_YAML, dict(do_sample=False, top_k=3)),
        (RequestParams(do_sample=False), YAML_SAMPLES, dict(do_sample=False, top_k=3)),
        (RequestParams(do_sample=True), NO_YAML, dict(BUILTIN, do_sample=True)),
    ],
)
def test_ms_default_rules(req, defaults, expected):
    got = resolve(req, defaults, vocab_size=1000)
    assert {name: getattr(got, name) for name in expected} == expected


@pytest.mark.parametrize(
    "req_top_k, yaml_top_k, vocab, expected",
    [
        (10, None, 5, 5),
        (5, None, 5, 5),
        (4, None, 5, 4),
        (2147483647, None, 49152, 49152),
        (None, 100, 50, 50),  # a yaml default is clamped too
        (None, 7, 50, 7),
        (None, None, 50, None),  # off (the yaml reader turns a yaml top_k of 0 into None)
    ],
)
def test_top_k_clamped_to_vocab(req_top_k, yaml_top_k, vocab, expected):
    got = resolve(RequestParams(top_k=req_top_k), ModelDefaults(top_k=yaml_top_k), vocab_size=vocab)
    assert got.top_k == expected


class RecordingSource:
    def __init__(self, value):
        self.value, self.calls = value, []

    def randint(self, a, b):
        self.calls.append((a, b))
        return self.value


def test_given_seed_is_kept_and_no_draw_happens():
    source = RecordingSource(99)
    assert resolve(RequestParams(seed=SEED_MAX), NO_YAML, 10, source).seed == SEED_MAX
    assert resolve(RequestParams(seed=1), NO_YAML, 10, source).seed == 1
    assert source.calls == []


def test_unset_seed_is_drawn_over_the_whole_uint64_range():
    source = RecordingSource(123456789)
    assert resolve(RequestParams(), NO_YAML, 10, source).seed == 123456789
    assert source.calls == [(1, 2**64 - 1)]


def test_drawn_seeds_are_uint64_and_vary():
    seeds = {draw_seed() for _ in range(8)}
    assert len(seeds) == 8
    assert all(1 <= s <= SEED_MAX for s in seeds)
    assert max(seeds) > 2**40  # drawn from the full range, not a 32-bit one
    assert draw_seed(random.Random(5)) == random.Random(5).randint(1, SEED_MAX)


@pytest.mark.parametrize(
    "max_new, max_iter, max_seq, prompt, expected",
    [
        (20, 512, 2048, 8, 20),
        (1000, 512, 2048, 8, 512),
        (1000, 4096, 2048, 2000, 48),
        (5, 5, 10, 5, 5),
        (100, 100, 10, 9, 1),
    ],
)
def test_effective_max_new_tokens(max_new, max_iter, max_seq, prompt, expected):
    assert effective_max_new_tokens(max_new, max_iter, max_seq, prompt) == expected
