"""The continuous-batching scheduler's plan, step by step (pure logic: no model)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from backends.mindspore.engine.kv_cache import BlockAllocator
from backends.mindspore.engine.scheduler import Scheduler
from backends.mindspore.engine.sequence import SeqState

from tests.support.sequences import seq


def run_prefill(sched: Scheduler, plan) -> None:
    """What the engine does with a plan's prefill part."""
    for s, n in plan.prefill:
        s.prefilled += n
        if s.prefilled == len(s.prompt_ids):
            sched.prefill_done(s)
            s.generated.append(0)


def make(max_batch=8, rows=8, tokens=64, chunk=64, prefill_first=3, blocks=200) -> Scheduler:
    return Scheduler(BlockAllocator(blocks, 16), max_batch, 100, prefill_rows=rows, prefill_tokens=tokens,
                     chunk=chunk, prefill_first=prefill_first)


def test_short_prompts_are_packed_into_one_chunk_budget():
    sched = make()
    seqs = [seq(32) for _ in range(8)]
    for s in seqs:
        sched.add(s)
    plan = sched.plan()
    assert [(s, n) for s, n in plan.prefill] == [(seqs[0], 32), (seqs[1], 32)]  # 64 tokens: two prompts


def test_a_long_prompt_takes_whole_chunks_then_packs_with_the_next():
    sched = make()
    a, b = seq(100), seq(20)
    sched.add(a)
    sched.add(b)
    plan = sched.plan()
    assert [(s, n) for s, n in plan.prefill] == [(a, 64)]
    run_prefill(sched, plan)
    plan = sched.plan()
    assert [(s, n) for s, n in plan.prefill] == [(a, 36), (b, 20)]


@pytest.mark.parametrize("step_tokens, running, chunks", [
    (0, 3, [64]),            # no step limit: the prefill budget alone
    (80, 0, [64, 16]),       # the largest packed graph holds 80: the second prompt fills past the budget
    (80, 3, [64, 13]),       # ... beside the 3 decode rows
    (80, 16, [64]),          # never below the prefill budget
    (72, 3, [64, 5]),
])
def test_prompts_fill_the_step_up_to_step_tokens_each_at_most_a_chunk(step_tokens, running, chunks):
    sched = Scheduler(BlockAllocator(400, 16), 32, 100, prefill_rows=8, prefill_tokens=64, chunk=64,
                      step_tokens=step_tokens, prefill_first=0)
    for _ in range(running):
        s = seq(4)
        sched.add(s)
        run_prefill(sched, sched.plan())
    assert len(sched.running) == running
    a, b = seq(100), seq(100)
    sched.add(a)
    sched.add(b)
    plan = sched.plan()
    assert [n for _, n in plan.prefill] == chunks
    assert len(plan.decode) == running
    assert sum(chunks) + running <= max(step_tokens, 64 + running)


def test_prompts_go_first_for_at_most_prefill_first_steps_then_the_running_batch_decodes():
    sched = make(max_batch=16, prefill_first=3)
    first = seq(64)
    sched.add(first)
    run_prefill(sched, sched.plan())
    assert sched.running == [first]
    for _ in range(10):
        sched.add(seq(64))
    decoded = []
    for _ in range(8):
        plan = sched.plan()
        assert plan.prefill
        decoded.append(bool(plan.decode))
        run_prefill(sched, plan)
    assert decoded == [False, False, False, True, False, False, False, True]


def test_without_waiting_prompts_every_step_decodes():
    sched = make()
    a = seq(10)
    sched.add(a)
    run_prefill(sched, sched.plan())
    for _ in range(5):
        plan = sched.plan()
        assert plan.prefill == () and plan.decode == (a,)


def test_admission_respects_max_batch_and_the_cache():
    sched = make(max_batch=2, blocks=1 + 6)  # 6 usable blocks of 16 tokens
    seqs = [seq(20, new=12) for _ in range(3)]  # 32 tokens = 2 blocks each
    for s in seqs:
        sched.add(s)
    sched.plan()
    assert len(sched.prefilling) == 2 and len(sched.waiting) == 1  # max_batch
    sched.finish(seqs[0])
    sched.plan()
    assert seqs[2] in sched.prefilling
    big = seq(200, new=50)  # 16 blocks: more than the cache holds now
    sched.add(big)
    sched.plan()
    assert big in sched.waiting


# --- priority: lower is more urgent; starvation bounded by overtakings --------------------------------

def prioritized(prompt: int, priority: int, new: int = 8) -> SeqState:
    s = seq(prompt, new)
    s.priority = priority
    return s


@pytest.mark.parametrize("priorities, max_batch, admitted", [
    ([0, 0, 0], 2, [0, 1]),  # all equal: first come, first served
    ([5, 0, -1, 0], 2, [2, 1]),  # most urgent, then the earlier of two equals
    ([3, 2, 1], 3, [2, 1, 0]),
    ([0, -7, 0, -7], 4, [1, 3, 0, 2]),
    ([2147483647, -2147483648], 1, [1]),
])
def test_admission_takes_the_most_urgent_then_the_earliest(priorities, max_batch, admitted):
    sched = make(max_batch=max_batch, rows=1)
    seqs = [prioritized(4, p) for p in priorities]
    for s in seqs:
        sched.add(s)
    sched.plan()
    assert list(sched.prefilling) == [seqs[i] for i in admitted]


@pytest.mark.parametrize("priorities, rows, chunks", [
    ([0, 0, 0], 2, [0, 1]),
    ([1, 0, 2], 1, [1]),
    ([1, 0, 2], 2, [1, 0]),
    ([0, -1, -1], 3, [1, 2, 0]),
])
def test_prompt_chunks_go_to_the_most_urgent(priorities, rows, chunks):
    sched = make(max_batch=8, rows=rows, tokens=64, chunk=16)
    seqs = [prioritized(40, p) for p in priorities]
    for s in seqs:
        sched.add(s)
    plan = sched.plan()
    assert [s for s, _ in plan.prefill] == [seqs[i] for i in chunks]


@pytest.mark.parametrize("patience", [1, 2, 5])
def test_a_low_priority_request_waits_for_at_most_patience_later_arrivals(patience):
    """One slot; a request at priority 10, then an urgent one arriving each time the slot frees: the urgent
    ones overtake it exactly ``patience`` times, then it is admitted ahead of the next one."""
    sched = Scheduler(BlockAllocator(200, 16), 1, 100, prefill_rows=1, prefill_tokens=64,
                      priority_patience=patience)
    low = prioritized(4, 10)
    sched.add(low)
    order = []
    for _ in range(patience + 2):
        sched.add(prioritized(4, -5))
        sched.plan()
        (admitted,) = sched.prefilling
        order.append(admitted)
        sched.finish(admitted)
    assert order.index(low) == patience
    assert all(s.priority == -5 for i, s in enumerate(order) if i != patience)


@pytest.mark.parametrize("patience", [1, 3])
def test_a_low_priority_prompt_gets_a_chunk_after_at_most_patience_overtakings(patience):
    """One prompt row per step; a long prompt at priority 10 and a stream of urgent long prompts: it gets its
    first chunk once later arrivals took the row ``patience`` times."""
    sched = Scheduler(BlockAllocator(400, 16), 16, 100, prefill_rows=1, prefill_tokens=16, chunk=16,
                      priority_patience=patience, prefill_first=0)
    low = prioritized(64, 10)
    sched.add(low)
    chunks_before = 0
    for _ in range(patience + 3):
        sched.add(prioritized(64, 0))
        plan = sched.plan()
        ((chunked, _),) = plan.prefill
        run_prefill(sched, plan)
        if chunked is low:
            break
        chunks_before += 1
    assert chunks_before == patience


def test_by_priority_counts_waiting_and_running():
    sched = make(max_batch=2, rows=2)
    seqs = [prioritized(4, p) for p in (3, -1, 3, 0)]
    for s in seqs:
        sched.add(s)
    run_prefill(sched, sched.plan())  # -1 and 0 admitted and prefilled: running
    assert sched.by_priority() == {-1: {"waiting": 0, "running": 1}, 0: {"waiting": 0, "running": 1},
                                   3: {"waiting": 2, "running": 0}}


def test_queue_load_counts_the_prompt_tokens_still_to_compute_and_names_the_adapters():
    """What a gateway reads (GET /v1/loads, vllm:lora_requests_info): the queued prompts' tokens not yet
    computed, and the adapters of the running and of the waiting requests."""
    sched = make(max_batch=1, rows=1)
    running, queued = seq(20), seq(30)
    queued.lora = SimpleNamespace(name="fr", slot=0)
    sched.add(running)
    sched.add(queued)
    assert sched.queue_load()["waiting_prompt_tokens"] == 50
    run_prefill(sched, sched.plan())  # the first runs; the second waits for a batch row
    assert sched.queue_load() == {"waiting_prompt_tokens": 30, "running_adapters": [], "waiting_adapters": ["fr"]}
