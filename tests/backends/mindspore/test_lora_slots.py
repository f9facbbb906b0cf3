"""Adapter slots (backends/mindspore/engine/lora_slots.py) and the scheduler's maxLoras rule: pure logic, no model.

The slot packing is checked against a NumPy delta written here: for every row, x @ (scale * B @ A).T per
projection equals what the kernels compute from the packed a/b (x @ a[s]) @ b[s] on that projection's columns.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends.errors import ParameterRejected
from backends.lora import BaseDims, LoraAdapter, LoraModule
from backends.mindspore.engine.kv_cache import BlockAllocator
from backends.mindspore.engine.lora_slots import LoraSlots, adapter_fits, pack_slot
from backends.mindspore.network.lora_groups import GROUPS, group_segments
from backends.mindspore.engine.scheduler import Scheduler
from backends.mindspore.engine.sequence import SeqState

DIMS = BaseDims(num_layers=2, hidden=12, q_out=12, kv_out=4, intermediate=20)


def adapter(name: str, rank: int, targets: tuple[str, ...], seed: int, scale: float = 0.5) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    modules = {}
    for layer in range(DIMS.num_layers):
        for proj in targets:
            k, n = DIMS.shape(proj)
            modules[layer, proj] = LoraModule(rng.standard_normal((rank, k)).astype(np.float32),
                                              rng.standard_normal((n, rank)).astype(np.float32), scale)
    return LoraAdapter(name, Path("/nowhere"), rank, targets, scale, False, modules)


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("targets", [tuple(p for g in GROUPS.values() for p in g), ("q_proj", "v_proj"),
                                     ("down_proj",)])
def test_packed_slot_reproduces_each_projections_delta(group, targets):
    rank, slot_rank = 3, 5  # an adapter of rank 3 in slots of rank 5: the padding adds exact zeros
    ad = adapter("x", rank, targets, seed=7)
    a, b = pack_slot(ad, 1, group, DIMS, slot_rank)
    x = np.random.default_rng(1).standard_normal((4, a.shape[0]))
    t = x @ a  # [4, G*R]
    segs = group_segments(DIMS, group)
    for g, proj in enumerate(GROUPS[group]):
        got = t[:, g * slot_rank:(g + 1) * slot_rank] @ b[:, segs[g]:segs[g + 1]]
        module = ad.modules.get((1, proj))
        want = (x @ (module.scale * module.b.astype(np.float64) @ module.a).T if module is not None
                else np.zeros_like(got))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class _Net:
    """Records what LoraSlots writes into the network."""

    def __init__(self) -> None:
        self.writes: dict[tuple[int, int, str], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, slot, layer, group, a, b) -> None:
        self.writes[slot, layer, group] = (a, b)


def test_load_fills_every_layer_and_group_then_acquire_and_unload_follow_the_leases():
    net = _Net()
    slots = LoraSlots(DIMS, 2, 4, net)
    first = slots.load(adapter("sql", 4, ("q_proj",), 1))
    assert {(s, layer, g) for s, layer, g in net.writes} == {(first, layer, g) for layer in range(2) for g in GROUPS}
    second = slots.load(adapter("chat", 2, ("down_proj",), 2))
    assert {first, second} == {0, 1}
    with pytest.raises(ValueError, match="no free adapter slot"):
        slots.load(adapter("third", 2, ("q_proj",), 3))
    with pytest.raises(ValueError, match="already loaded"):
        slots.load(adapter("sql", 2, ("q_proj",), 3))
    with pytest.raises(ValueError, match="over maxLoraRank 4"):
        LoraSlots(DIMS, 1, 4, net).load(adapter("big", 8, ("q_proj",), 3))

    lease = slots.acquire("sql")
    assert (lease.slot, lease.name) == (first, "sql")
    assert slots.unload("sql") is False  # a request is in flight: the slot stays
    with pytest.raises(ParameterRejected, match='"sql" is not a loaded adapter \\(loaded: chat\\)') as err:
        slots.acquire("sql")
    assert err.value.param == "adapter_id"
    lease.release()
    lease.release()  # idempotent
    assert slots.names() == ["chat"]
    assert slots.load(adapter("sql2", 2, ("q_proj",), 4)) == first  # the freed slot is reused
    assert slots.unload("chat") is True
    with pytest.raises(KeyError):
        slots.unload("chat")


def test_a_reloaded_name_gets_a_new_prefix_cache_key():
    """Cached KV blocks of an unloaded adapter must never match a new adapter of the same name."""
    slots = LoraSlots(DIMS, 1, 4, _Net())
    slots.load(adapter("a", 2, ("q_proj",), 1))
    old = slots.acquire("a")
    old.release()
    slots.unload("a")
    slots.load(adapter("a", 2, ("q_proj",), 2))
    new = slots.acquire("a")
    assert new.key != old.key and new.slot == old.slot


@pytest.mark.parametrize("adapter_id, active, limit, fits", [
    (None, {"a", "b"}, 2, True),  # the base model never counts
    ("a", {"a", "b"}, 2, True),
    ("c", {"a", "b"}, 2, False),
    ("c", {"a"}, 2, True),
    ("c", {"a", "b"}, 0, True),  # 0: no limit
])
def test_adapter_fits(adapter_id, active, limit, fits):
    assert adapter_fits(adapter_id, active, limit) is fits


# --- the scheduler's maxLoras rule --------------------------------------------------------------------

class _Handle:
    cancelled = False


class _Lease:
    def __init__(self, name: str) -> None:
        self.name, self.slot, self.key = name, 0, name

    def release(self) -> None:
        pass


def seq(adapter_id: str | None, prompt: int = 8) -> SeqState:
    s = SeqState(handle=_Handle(), prompt_ids=list(range(prompt)), max_new_tokens=4, chooser=None, stopper=None,
                 detokenizer=None, seed=1)
    s.lora = _Lease(adapter_id) if adapter_id is not None else None
    return s


def admitted(sched: Scheduler) -> list[SeqState]:
    sched.plan()
    return [*sched.prefilling, *sched.running]


def test_max_loras_holds_back_a_third_adapter_and_lets_the_others_pass():
    sched = Scheduler(BlockAllocator(200, 16), 16, 100, max_loras=2, prefill_rows=16, prefill_tokens=512)
    a, b, c, base, a2 = seq("a"), seq("b"), seq("c"), seq(None), seq("a")
    for s in (a, b, c, base, a2):
        sched.add(s)
    active = admitted(sched)
    assert active == [a, b, base, a2]  # c would be a third distinct adapter
    assert list(sched.waiting) == [c]
    assert {s.adapter for s in active if s.adapter} == {"a", "b"}
    sched.finish(b)
    assert c in admitted(sched)  # b's slot in the step is free now


def test_a_held_back_request_is_not_starved():
    patience = 3
    sched = Scheduler(BlockAllocator(400, 16), 64, 100, max_loras=1, patience=patience, prefill_rows=64,
                      prefill_tokens=4096)
    first = seq("a")
    sched.add(first)
    admitted(sched)
    held = seq("b")
    sched.add(held)
    for _ in range(10):  # a stream of "a" requests behind the held-back "b"
        sched.add(seq("a"))
    active = admitted(sched)
    assert held not in active
    assert len(active) == 1 + patience  # "a" requests overtook it only `patience` times
    for s in list(active):
        sched.finish(s)
    active = admitted(sched)
    assert active[0] is held  # then it goes first, before the "a" requests still waiting
    assert all(s.adapter == "b" for s in active)


def test_slot_bytes_count_every_group_twice_in_float32():
    from backends.mindspore.engine.lora_slots import slot_bytes

    h, q, kv, f = DIMS.hidden, DIMS.q_out, DIMS.kv_out, DIMS.intermediate
    rank, slots = 4, 3
    per_layer = rank * ((h * 3 + q + 2 * kv) + (q + h) + (h * 2 + 2 * f) + (f + h))  # a: K x G*R, b: R x N
    assert slot_bytes(DIMS, (slots, rank)) == 2 * 4 * DIMS.num_layers * slots * per_layer
    assert slot_bytes(DIMS, None) == 0
