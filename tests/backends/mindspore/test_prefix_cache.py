"""Automatic prefix caching, as bookkeeping: chained block hashes, shared refcounted blocks, least recently
used eviction only when free blocks run out, and the scheduler starting a prompt after its cached blocks
(pure logic: no model; the outputs' bit-identity is in test_engine_prefix_cache.py)."""
from __future__ import annotations

import pytest

from backends.mindspore.engine.kv_cache import BlockAllocator, CacheFull, block_hashes, part_hashes
from backends.mindspore.engine.scheduler import Scheduler
from backends.mindspore.engine.sequence import SeqState

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


# --- parts of a block (BS 8, parts of 2): a prompt sharing only the first rows of a block copies them ---

PBS, PART = 8, 2


def test_part_hashes_cover_each_blocks_first_parts_short_of_a_full_block():
    ids = list(range(21))  # blocks 0..7, 8..15 full; 16..20 partial
    full = block_hashes(ids, PBS)
    parts = part_hashes(ids, PBS, PART, full)
    assert [len(p) for p in parts] == [3, 3, 2]  # ends 2, 4, 6 | 10, 12, 14 | 18, 20: never a whole block
    assert part_hashes(ids[:20], PBS, PART, full)[:2] == parts[:2]  # a part depends on nothing after it
    changed = ids[:9] + [99] + ids[10:]  # token 9: block 1's parts from its first on, not block 0's
    other = part_hashes(changed, PBS, PART, block_hashes(changed, PBS))
    assert other[0] == parts[0] and all(a != b for a, b in zip(other[1], parts[1]))
    before = part_hashes([50] + ids[1:], PBS, PART, block_hashes([50] + ids[1:], PBS))
    assert all(a != b for x, y in zip(before[1:], parts[1:]) for a, b in zip(x, y))  # token 0 is before them
    assert part_hashes(ids, PBS, PART, full, adapter="sql-lora")[0][0] != parts[0][0]
    assert set(parts[0]).isdisjoint(full) and part_hashes(ids, PBS, 0, full) == []


def test_parts_need_a_divisor_of_the_block_below_it_and_prefix_caching():
    assert BlockAllocator(8, 8, True, part_size=2).part_size == 2
    assert [BlockAllocator(8, 8, True, part_size=n).part_size for n in (8, 3, 16)] == [0, 0, 0]
    assert BlockAllocator(8, 8, False, part_size=2).part_size == 0


def make_parts(copies: list, blocks: int = 64) -> Scheduler:
    return Scheduler(BlockAllocator(blocks, PBS, prefix_caching=True, part_size=PART), 8, 100, prefill_rows=4,
                     prefill_tokens=64, chunk=8, prefill_first=0, copy_rows=lambda *a: copies.append(a))


def test_a_prompt_sharing_the_first_rows_of_a_block_copies_them_and_starts_after():
    copies = []
    sched = make_parts(copies)
    a = seq(list(range(100, 111)))  # a full block, then 3 rows of the next: its parts of 2 end at row 10
    sched.add(a)
    prefill_all(sched)
    b = seq(list(range(100, 111)) + [7, 8])  # shares all 11 tokens: the full block, then one part of 2
    sched.add(b)
    plan = sched.plan()
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert copies == [(a.blocks[1], b.blocks[1], 2)] and b.prefilled == 10
    assert plan.prefill == ((b, 3),) and (sched.prompt_tokens, sched.hit_tokens) == (11 + 13, 10)
    c = seq(list(range(100, 111)))  # a's very prompt: its last token is computed, the part before it copied
    sched.add(c)
    sched.plan()
    assert c.prefilled == 10 and copies[-1] == (a.blocks[1], c.blocks[1], 2)


def test_a_prompt_shorter_than_a_block_copies_the_longest_cached_part():
    copies = []
    sched = make_parts(copies)
    a = seq(list(range(7)))  # parts end at 2, 4, 6
    sched.add(a)
    prefill_all(sched)
    sched.finish(a)  # its block stays cached for its parts
    assert sched.allocator.cached_blocks == 1
    b = seq([0, 1, 2, 3, 9, 9])  # shares 4 tokens
    sched.add(b)
    sched.plan()
    assert len(copies) == 1 and copies[0][1:] == (b.blocks[0], 4) and b.prefilled == 4
    assert copies[0][0] != b.blocks[0]
    d = seq([5, 1, 2, 3])  # differs in the first part: nothing
    sched.add(d)
    sched.plan()
    assert len(copies) == 1 and d.prefilled == 0


def test_no_copy_for_a_request_wanting_every_prompt_logprob_or_without_a_copier():
    copies = []
    sched = make_parts(copies)
    sched.add(seq(list(range(7))))
    prefill_all(sched)
    details = seq(list(range(7)), want_prefill=True)
    sched.add(details)
    sched.plan()
    assert details.prefilled == 0 and copies == []
    plain = Scheduler(BlockAllocator(64, PBS, prefix_caching=True, part_size=PART), 8, 100, chunk=8)
    plain.add(seq(list(range(7))))
    prefill_all(plain)
    again = seq(list(range(7)))
    plain.add(again)
    plain.plan()
    assert again.prefilled == 0  # no copy_rows: parts are neither registered nor matched
    assert plain.allocator.cached_blocks == 0


def test_the_source_block_is_held_while_copied_or_adopted_when_holding_it_would_not_fit():
    copies = []
    sched = make_parts(copies, blocks=4)  # 3 usable blocks
    a = seq(list(range(7)), new=1)
    sched.add(a)
    prefill_all(sched)
    source = a.blocks[0]
    sched.finish(a)  # idle: the only cached block
    c = seq([0, 1, 2, 3, 4, 5, 9], new=8)  # 15 tokens: 2 fresh blocks beside the held source
    sched.add(c)
    sched.plan()
    assert copies == [(source, c.blocks[0], 6)] and source not in c.blocks and c.prefilled == 6
    sched.finish(c)
    assert sched.allocator.match_part(part_hashes(list(range(7)), PBS, PART, [])[0]) == (source, 6)
    b = seq([0, 1, 2, 3, 4, 5, 9], new=16)  # 23 tokens: all 3 blocks, the source among them
    sched.add(b)
    sched.plan()
    assert len(copies) == 1 and b.blocks[0] == source and b.prefilled == 6  # its rows are there: no copy
    assert sched.allocator.match_part(part_hashes(list(range(7)), PBS, PART, [])[0]) is None  # b writes on
    prefill_all(sched)
    assert sched.allocator.match_part(part_hashes(list(range(7)), PBS, PART, [])[0]) == (source, 6)  # b's now
    with pytest.raises(ValueError, match="in use"):
        sched.allocator.allocate(1, (), source, adopt=True)


def test_parts_are_evicted_with_their_block():
    alloc = BlockAllocator(3, PBS, prefix_caching=True, part_size=PART)  # 2 usable
    ids = list(range(5))
    parts = part_hashes(ids, PBS, PART, block_hashes(ids, PBS))
    blocks = alloc.allocate(5)
    block = blocks[0]
    for digest in parts[0]:
        alloc.register_part(block, digest)
    alloc.release(blocks)  # idle, findable by its parts
    assert alloc.match_part(parts[0]) == (block, 4) and alloc.match_part(parts[0][:1]) == (block, 2)
    alloc.allocate(16)  # both blocks: the cached one is evicted
    assert alloc.match_part(parts[0]) is None and alloc.cached_blocks == 0
