"""The graph launcher (runners/launch.py): each input signature's compiled graph found once through ``Cell.__call__``,
later calls straight to it, with the Cell's own results."""
from __future__ import annotations

import numpy as np
import pytest

from backends.mindspore.planning.device import set_mode

pytestmark = pytest.mark.slow  # compiles graphs


def test_each_signature_runs_its_own_graph_with_the_cells_results(monkeypatch):
    import mindspore as ms
    from mindspore import nn, ops

    from backends.mindspore.runners.launch import Launcher

    set_mode(0, "CPU", 2)

    class Net(nn.Cell):
        def construct(self, x, w, bias=None):
            y = ops.matmul(x, w)
            return (y, y.sum(-1)) if bias is None else (y + bias, y.sum(-1))

    net, calls = Net(), []
    plain = Net.__call__
    monkeypatch.setattr(Net, "__call__", lambda self, *a: (calls.append(len(a)), plain(self, *a))[1])
    launch = Launcher(net)
    rng = np.random.default_rng(0)
    inputs = {"3x4": (rng.standard_normal((3, 4), np.float32), rng.standard_normal((4, 5), np.float32), None),
              "2x4": (rng.standard_normal((2, 4), np.float32), rng.standard_normal((4, 5), np.float32), None),
              "bias": (rng.standard_normal((3, 4), np.float32), rng.standard_normal((4, 5), np.float32),
                       rng.standard_normal(5).astype(np.float32))}
    for name in ["3x4", "2x4", "3x4", "bias", "2x4", "bias", "3x4"]:
        x, w, bias = inputs[name]
        got = [t.asnumpy() for t in launch(x, w, bias)]
        want = [t.asnumpy() for t in plain(net, *(None if a is None else ms.Tensor(a) for a in (x, w, bias)))]
        assert [g.shape for g in got] == [w_.shape for w_ in want], name
        assert all(np.array_equal(g, w_) for g, w_ in zip(got, want)), name
    assert len(calls) == 3  # one Cell call per signature; the other four went straight to the graph
