"""backends/step_stats.py: the engine steps' histograms, counted as Prometheus counts them."""
from __future__ import annotations

import pytest

from backends.step_stats import DURATION_BUCKETS, KINDS, TOKEN_BUCKETS, StepStats


def test_a_new_recorder_has_every_kind_and_nothing_in_it():
    snapshot = StepStats().snapshot()
    assert set(snapshot) == set(KINDS)
    for kind in KINDS:
        assert snapshot[kind]["seconds"] == {"buckets": [(le, 0) for le in DURATION_BUCKETS], "count": 0, "sum": 0.0}
        assert snapshot[kind]["tokens"]["buckets"] == [(le, 0) for le in TOKEN_BUCKETS]


def test_buckets_are_cumulative_and_an_edge_counts_in_its_own_bucket():
    stats = StepStats()
    for seconds, tokens in ((0.004, 1), (0.005, 16), (0.03, 17), (9.0, 10000)):
        stats.record("decode", seconds, tokens)
    stats.record("prefill", 0.4, 300)
    decode = stats.snapshot()["decode"]
    seconds = dict(decode["seconds"]["buckets"])
    assert (seconds[0.0025], seconds[0.005], seconds[0.02], seconds[0.03], seconds[5.0]) == (0, 2, 2, 3, 3)
    assert decode["seconds"]["count"] == 4 and decode["seconds"]["sum"] == pytest.approx(9.039)
    tokens = dict(decode["tokens"]["buckets"])
    assert (tokens[1], tokens[8], tokens[16], tokens[32], tokens[8192]) == (1, 1, 2, 3, 3)
    assert decode["tokens"]["count"] == 4 and decode["tokens"]["sum"] == 10034
    prefill = stats.snapshot()["prefill"]
    assert prefill["tokens"]["count"] == 1 and dict(prefill["tokens"]["buckets"])[256] == 0
    assert dict(prefill["tokens"]["buckets"])[512] == 1


def test_an_unknown_kind_is_refused():
    with pytest.raises(KeyError):
        StepStats().record("verify", 0.01, 1)
