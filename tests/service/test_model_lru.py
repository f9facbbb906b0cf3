"""The rule that picks which model makes room for a load (service/model_lru.py): table-style, pure."""
from __future__ import annotations

import pytest

from service.model_lru import Decision, ModelState, Plan, Resident, plan_load

L, U, LOADING, DRAIN = ModelState.LOADED, ModelState.UNLOADED, ModelState.LOADING, ModelState.UNLOADING


def m(name, state, in_flight=0, last_used=0.0):
    return Resident(name, state, in_flight, last_used)


@pytest.mark.parametrize("models, limit, expected", [
    # room left: load at once
    ([m("a", L), m("b", U)], 2, Plan(Decision.LOAD)),
    ([m("a", U), m("b", U)], 1, Plan(Decision.LOAD)),
    # full: the least recently used idle model goes
    ([m("a", L, 0, 5.0), m("b", L, 0, 3.0), m("c", U)], 2, Plan(Decision.EVICT, "b")),
    # an idle model goes before a busy one, even a busy one used longer ago
    ([m("a", L, 2, 1.0), m("b", L, 0, 9.0), m("c", U)], 2, Plan(Decision.EVICT, "b")),
    # every loaded model busy: the least recently used drains (never starved by traffic)
    ([m("a", L, 1, 4.0), m("b", L, 3, 2.0), m("c", U)], 2, Plan(Decision.EVICT, "b")),
    ([m("a", L, 1, 0.0), m("b", U)], 1, Plan(Decision.EVICT, "a")),
    # a model is draining or loading already: wait for it
    ([m("a", DRAIN, 1), m("b", U)], 1, Plan(Decision.WAIT)),
    ([m("a", LOADING), m("b", L), m("c", U)], 2, Plan(Decision.WAIT)),
    # a draining model still counts against the limit; an unloaded one does not
    ([m("a", DRAIN), m("b", L, 0, 1.0), m("c", U)], 3, Plan(Decision.LOAD)),
    ([m("a", U), m("b", U), m("c", L, 0, 1.0)], 1, Plan(Decision.EVICT, "c")),
])
def test_plan_load(models, limit, expected):
    assert plan_load(models, limit) == expected
