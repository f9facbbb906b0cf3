"""Automatic prefix caching, as bookkeeping: chained block hashes, shared refcounted blocks, least recently
used eviction only when free blocks run out, and the scheduler starting a prompt after its cached blocks
(pure logic: no model; the outputs' bit-identity is in test_engine_prefix_cache.py)."""
from __future__ import annotations

import pytest

from backends.mindspore.kv_cache import BlockAllocator, CacheFull, block_hashes
from backends.mindspore.scheduler import Scheduler
from backends.mindspore.sequence import SeqState

BS = 4


class _Handle:
    cancelled = False


def seq(prompt: list[int], new: int = 4, want_prefill: bool = False) -> SeqState:
    return SeqState(handle=_Handle(), prompt_ids=list(prompt), max_new_tokens=new, chooser=None, stopper=None,
                    detokenizer=None, seed=1, want_prefill=want_prefill)


def test_block_hashes_chain_over_everything_before_and_skip_the_partial_block():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2  # the ninth token is a partial block: never hashed
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different first: different hash
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS) == a  # deterministic
    assert block_hashes([1, 2, 3, 4], BS, adapter="sql-lora") != a[:1]  # the adapter is part of the hash


def test_a_registered_block_is_shared_and_refcounted():
    alloc = BlockAllocator(10, BS, prefix_caching=True)
    hashes = block_hashes(range(8), BS)
    first = alloc.allocate(10)  # 3 blocks
    for digest, block in zip(hashes, first):
        alloc.register(block, digest)
    assert alloc.match(hashes) == first[:2] and alloc.cached_blocks == 2
    second = alloc.allocate(10, alloc.match(hashes))
    assert second[:2] == first[:2] and second[2] not in first
    assert alloc.free_blocks == 9 - 4
    shared = second[:2]
    alloc.release(first)  # (release empties the list it is given)
    assert alloc.free_blocks == 9 - 3  # the shared blocks are still used by the second
    alloc.release(second)
    assert alloc.free_blocks == 9 and alloc.cached_blocks == 2  # idle, still findable
    assert alloc.match(hashes) == shared


def test_idle_cached_blocks_are_evicted_least_recently_used_only_when_free_blocks_run_out():
    alloc = BlockAllocator(6, BS, prefix_caching=True)  # 5 usable
    old, new = block_hashes([1] * 4, BS), block_hashes([2] * 4, BS)
    for hashes in (old, new):
        blocks = alloc.allocate(4)
        alloc.register(blocks[0], hashes[0])
        alloc.release(blocks)
    assert alloc.cached_blocks == 2 and alloc.free_blocks == 5
    taken = alloc.allocate(12)  # 3 plain free blocks: nothing evicted
    assert alloc.cached_blocks == 2
    more = alloc.allocate(4)  # the least recently used idle block goes
    assert alloc.match(old) == [] and alloc.match(new) != [] and more[0] not in taken
    with pytest.raises(CacheFull):
        alloc.allocate(8)


def test_a_cached_block_in_use_counts_once_when_a_prompt_reuses_it():
    alloc = BlockAllocator(4, BS, prefix_caching=True)  # 3 usable
    hashes = block_hashes(range(4), BS)
    blocks = alloc.allocate(4)
    alloc.register(blocks[0], hashes[0])
    alloc.release(blocks)  # idle: counted free
    assert alloc.can_allocate(12, alloc.match(hashes))  # 1 shared (idle) + 2 fresh = the 3 blocks
    assert not alloc.can_allocate(16, alloc.match(hashes))


def test_without_prefix_caching_nothing_is_found_or_kept():
    alloc = BlockAllocator(6, BS)
    hashes = block_hashes(range(4), BS)
    blocks = alloc.allocate(4)
    alloc.register(blocks[0], hashes[0])
    alloc.release(blocks)
    assert alloc.match(hashes) == [] and alloc.cached_blocks == 0


def prefill_all(sched: Scheduler) -> None:
    """Plan and record prompt chunks until no prompt is left (what the engine does with them)."""
    while sched.prefilling or sched.waiting:
        plan = sched.plan()
        for s, n in plan.prefill:
            s.prefilled += n
            if s.prompt_done:
                sched.prefill_done(s)
                s.generated.append(0)


def make() -> Scheduler:
    return Scheduler(BlockAllocator(64, BS, prefix_caching=True), 8, 100, prefill_rows=4, prefill_tokens=64,
                     chunk=8, prefill_first=0)


def test_a_prompt_starting_with_cached_blocks_skips_their_prefill():
    sched = make()
    system = list(range(100, 112))  # 3 full blocks
    a = seq(system + [1, 2])
    sched.add(a)
    prefill_all(sched)
    b = seq(system + [7, 8, 9])
    sched.add(b)
    plan = sched.plan()
    assert b.prefilled == 12 and b.blocks[:3] == a.blocks[:3] and b.blocks[3] not in a.blocks
    assert plan.prefill == ((b, 3),)  # only the question is prefilled, from position 12
    assert (sched.prompt_tokens, sched.hit_tokens) == (14 + 15, 12)


def test_the_last_prompt_token_is_always_computed():
    sched = make()
    a = seq(list(range(8)))
    sched.add(a)
    prefill_all(sched)
    again = seq(list(range(8)))  # the same prompt, two full blocks
    sched.add(again)
    plan = sched.plan()
    assert again.prefilled == 4 and plan.prefill == ((again, 4),)  # the second block is recomputed privately
    assert again.blocks[1] != a.blocks[1]


def test_a_request_that_wants_every_prompt_logprob_prefills_everything():
    sched = make()
    sched.add(seq(list(range(12))))
    prefill_all(sched)
    details = seq(list(range(12)) + [5], want_prefill=True)
    sched.add(details)
    sched.plan()
    assert details.prefilled == 0


def test_blocks_are_registered_chunk_by_chunk_and_released_to_the_cache():
    sched = make()
    long = seq(list(range(20)))
    sched.add(long)
    run = sched.plan()
    long.prefilled += run.prefill[0][1]  # 8 tokens: 2 blocks written
    sched.plan()  # the next plan registers them
    assert sched.allocator.cached_blocks == 2
    sched.finish(long)
    assert sched.allocator.cached_blocks == 2 and sched.allocator.free_blocks == 63
