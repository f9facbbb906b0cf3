"""load_clock.py: the phases of a load add up per name in first-run order, a progress line comes at most every
``every`` seconds naming the layer being built, and outside a load the timed code runs untouched."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from backends.mindspore.planning import load_clock
from backends.mindspore.planning.load_clock import LoadClock, phase, timed


class _Time:
    """perf_counter and process_time under the test's control."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def run(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu


@pytest.fixture
def clock_time(monkeypatch) -> _Time:
    t = _Time()
    monkeypatch.setattr(load_clock.time, "perf_counter", lambda: t.wall)
    monkeypatch.setattr(load_clock.time, "process_time", lambda: t.cpu)
    return t


@timed("pack weights")
def _pack(parts: list, name: str, clock_time: _Time) -> str:
    clock_time.run(2.0, 1.5)
    return name.upper()


def test_phases_add_up_by_name_in_first_run_order(clock_time):
    with LoadClock(layers=4) as clock:
        with phase("read weights"):
            clock_time.run(3.0, 1.0)
        assert _pack([], "model.layers.0.wqkv", clock_time) == "MODEL.LAYERS.0.WQKV"
        assert _pack([], name="model.layers.1.wo", clock_time=clock_time) == "MODEL.LAYERS.1.WO"
        with phase("KV cache", "model.layers.1.k_cache"):
            clock_time.run(0.25, 0.25)
    assert clock.summary() == "read weights 3.0s, pack weights 4.0s, KV cache 0.2s"
    assert clock.summary(cpu=True) == ("read weights 3.0s (CPU 1.0s), pack weights 4.0s (CPU 3.0s), "
                                       "KV cache 0.2s (CPU 0.2s)")


def test_a_progress_line_at_most_every_few_seconds_naming_the_layer(clock_time, caplog):
    caplog.set_level(logging.INFO, logger="mindserve.engine")
    with LoadClock(layers=24, every=5.0):
        for i in range(6):
            _pack([], f"model.layers.{i}.w_gate_up", clock_time)  # 2 s each: lines at 6 s and 12 s
        with phase("embedding", "embed"):
            clock_time.run(6.0, 6.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["loading: layer 3/24 (pack weights 6.0s; 6s so far)",
                     "loading: layer 6/24 (pack weights 12.0s; 12s so far)",
                     "loading: embed (pack weights 12.0s, embedding 6.0s; 18s so far)"]


def test_outside_a_load_nothing_is_timed(clock_time, caplog):
    caplog.set_level(logging.INFO, logger="mindserve.engine")
    assert _pack([], "model.layers.0.wo", clock_time) == "MODEL.LAYERS.0.WO"
    with phase("read weights"):
        pass
    with LoadClock(layers=1) as clock:
        pass
    assert clock.summary() == "" and not caplog.records


def test_the_networks_phases_are_named_where_they_run():
    import mindspore as ms

    from backends.mindspore.network.common import aot_param, filled_param, kv_cache_param

    with LoadClock(layers=1) as clock:
        kv_cache_param("float16", 64, 8, "model.layers.0.k_cache")
        filled_param((4, 4), ms.float32, "model.layers.0.w", lambda out: out.fill(1.0))  # timed by its caller
        aot_param(np.ones((3, 2), np.float32), "embed")
    assert list(clock.seconds) == ["KV cache", "embedding"]
