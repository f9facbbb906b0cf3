"""The sliding-window layers' block pool (backends/mindspore/engine/window_pool.py): its sizing rule, the blocks a
sequence holds as its window slides, the reservation that admission keeps to, the prefix cache's hits shortened
to what the pool still holds; and, on the tiny Gemma 3 (a window of 8 tokens) behind the engine, that with the pool
the greedy ids and every logprob are the bits the full-length caches give, for sequences many windows long, run
together so that blocks freed by one are taken by another, and for prefix-cache hits past the window."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest

from backends.mindspore.engine.kv_cache import BlockAllocator, block_hashes
from backends.mindspore.engine.window_pool import WindowPool, first_read
from backends.mindspore.planning.windows import live_blocks
from backends.mindspore.runners.step import SCRATCH_BLOCK


@pytest.mark.parametrize("window, block, row, want", [
    (512, 128, 1, 5),  # a decode step: keys (p - 512, p] span 5 blocks when p is not the last of its block
    (512, 128, 64, 6),  # a 64-token chunk: [s - 511, s + 63], 575 keys
    (512, 128, 2, 5),
    (8, 16, 32, 4),
    (1, 16, 1, 1),
    (16, 16, 1, 2),
])
def test_live_blocks_is_the_most_a_step_touches(window, block, row, want):
    assert live_blocks(window, block, row) == want
    most = max(len({k // block for k in range(max(0, s - window + 1), s + row)}) for s in range(window + 4 * block))
    assert most == want  # checked against every start position


@dataclass(eq=False)
class _Seq:
    local_blocks: list[int] = field(default_factory=list)


def _pool(blocks: int, window: int = 8, block: int = 4, row: int = 4, caching: bool = False) -> WindowPool:
    return WindowPool(BlockAllocator(blocks, block, caching), window, row)


def test_a_sequence_holds_only_the_blocks_of_its_window():
    pool = _pool(16)  # window 8, blocks of 4, 4 positions a step: live_blocks 4
    seq = _Seq()
    pool.admit(seq, 100, 0, [])
    held = []
    for start in range(0, 60, 4):
        pool.advance(seq, start, start + 4)
        live = [i for i, b in enumerate(seq.local_blocks) if b != SCRATCH_BLOCK]
        assert live == list(range(first_read(start, 8, 4), (start + 3) // 4 + 1))
        assert len(live) <= pool.per_sequence
        held.append(pool.allocator.usable_blocks - pool.allocator.free_blocks)
    assert max(held) <= pool.per_sequence
    pool.finish(seq)
    assert pool.allocator.free_blocks == pool.allocator.usable_blocks and pool.reserved == 0


def test_admission_keeps_to_the_reservation():
    pool = _pool(9)  # 8 usable: two sequences of 4
    a, b = _Seq(), _Seq()
    assert pool.can_admit(100)
    pool.admit(a, 100, 0, [])
    pool.admit(b, 100, 0, [])
    assert not pool.can_admit(100)
    assert pool.can_admit(0) and pool.reservation(4) == 1  # a short sequence reserves its own blocks only
    for start in range(0, 40, 4):  # both slide: every block they take is there
        pool.advance(a, start, start + 4)
        pool.advance(b, start, start + 4)
    pool.finish(a)
    assert pool.can_admit(100)


def test_blocks_freed_by_one_sequence_are_taken_by_another():
    pool = _pool(9)
    a, b = _Seq(), _Seq()
    pool.admit(a, 100, 0, [])
    used = set()
    for start in range(0, 40, 4):  # ten blocks' worth of positions
        pool.advance(a, start, start + 4)
        used |= {x for x in a.local_blocks if x != SCRATCH_BLOCK}
    assert len(used) <= pool.per_sequence  # a reuses the blocks that slid out of its window
    assert a.local_blocks[:7] == [SCRATCH_BLOCK] * 7
    pool.advance(a, 43, 44)  # position 43 reads keys 36-43: block 8 slides out, nothing is taken
    freed = used - set(a.local_blocks)
    assert a.local_blocks[8] == SCRATCH_BLOCK and freed
    pool.admit(b, 100, 0, [])
    pool.advance(b, 0, 4)
    assert b.local_blocks[0] in freed


def test_a_prefix_hit_is_cut_to_the_window_the_pool_still_holds():
    pool = _pool(32, caching=True)
    ids = list(range(40))
    hashes = block_hashes(ids, 4)
    a = _Seq()
    pool.admit(a, 48, 0, [])
    for start in range(0, 40, 4):
        pool.advance(a, start, start + 4)
    pool.register(a, hashes)  # blocks 7-9 (positions 28-39), the ones a still holds, are registered
    n, shared = pool.match(hashes, 9)
    # a hit of 9 blocks starts at position 36: it reads keys 29-35, blocks 7-8, whose rows a still holds
    assert n == 9 and shared == [a.local_blocks[7], a.local_blocks[8]]
    assert pool.match(hashes, 10) == (10, a.local_blocks[8:10])
    # a hit of 7 would read blocks 5-6, slid out before they were registered, and so would any shorter one
    assert pool.match(hashes, 7) == (0, [])
    b = _Seq()
    pool.admit(b, 48, n, shared)
    assert b.local_blocks == [SCRATCH_BLOCK] * 7 + shared
    pool.finish(a)
    pool.finish(b)
    assert pool.match(hashes, 9) == (9, shared)  # idle now, still cached
    assert _pool(32, caching=True).match(hashes, 9) == (0, [])  # nothing cached: no hit
    assert _pool(32).match(hashes, 9) == (0, [])  # no prefix caching: no hit


def test_the_scheduler_admits_by_the_window_pool_too():
    from backends.mindspore.engine.scheduler import Scheduler

    from tests.support.sequences import seq

    pool = _pool(9, window=8, block=4, row=4)
    sched = Scheduler(BlockAllocator(64, 4), max_batch=8, max_waiting=8, chunk=4, prefill_tokens=8,
                      window_pool=pool, row_tokens=4)
    seqs = [seq(20, 20) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    sched.plan()
    assert len(sched.prefilling) + len(sched.running) == 2  # the pool reserves 4 blocks each: two fit, not three
    sched.finish(sched.prefilling[0])
    sched.plan()
    assert len(sched.prefilling) == 2


# --- the tiny Gemma 3 behind the engine: the pool against the full-length caches, bit for bit ---

PROMPTS = [
    "The river town woke slowly. " * 7,
    "Fishermen pulled their boats onto the gravel and the baker opened his shutters. " * 3,
    "Children ran along the towpath toward the old stone bridge. " * 4,
    "A heron stood motionless in the shallows.",
]


def _engine(model_dir, pool: bool):
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=256, max_input_tokens=176, max_batch_size=4, max_iter_times=96,
                          block_size=16, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4),
                          kernels="aot", threads=2, prefix_caching=True, window_pool=pool)
    return Engine(model_dir, config).start()


def _run(engine, prompts, details: bool = True) -> list[tuple]:
    from backends.types import RequestParams

    params = RequestParams(max_new_tokens=80, do_sample=False, ignore_eos=True, decoder_input_details=details)
    handles = [engine.submit(p, params) for p in prompts]
    out = []
    for h in handles:
        r = h.result(timeout=300)
        out.append(([t.id for t in r.tokens], [t.logprob for t in r.tokens], [t.logprob for t in r.prefill[1:]],
                    r.cached_tokens))
    return out


@pytest.fixture(scope="module")
def both(tiny_gemma3_dir):
    pooled, full = _engine(tiny_gemma3_dir, True), _engine(tiny_gemma3_dir, False)
    yield pooled, full
    pooled.close()
    full.close()


@pytest.mark.slow
def test_the_engine_has_a_window_pool_only_when_asked(both):
    pooled, full = both
    assert pooled.scheduler.window_pool is not None and full.scheduler.window_pool is None
    # 4 sequences x live_blocks(8, 16, 32) = 4 blocks + scratch, against 16 full-length blocks each
    assert pooled.scheduler.window_pool.allocator.num_blocks == 17
    assert pooled.runner.window_blocks == 17 and full.runner.window_blocks == 0


@pytest.mark.slow
def test_long_sequences_run_together_give_the_full_caches_bits(both):
    """Prompts of up to ~130 tokens and 80 greedy steps (up to 26 windows), four at a time, then again one by one:
    windowed layers that read a block after it was freed and taken by another sequence would move the logprobs."""
    pooled, full = both
    want = _run(full, PROMPTS)
    assert max(len(ids) for ids, *_ in want) == 80
    got = _run(pooled, PROMPTS)
    for (gi, gl, gp, _), (wi, wl, wp, _) in zip(got, want):
        assert gi == wi
        assert np.array_equal(np.array(gl), np.array(wl)) and np.array_equal(np.array(gp), np.array(wp))
    alone = list(itertools.chain.from_iterable(_run(pooled, [p]) for p in PROMPTS))
    assert [a[:3] for a in alone] == [g[:3] for g in got]


@pytest.mark.slow
def test_prefix_hits_past_the_window_give_the_full_caches_bits(both):
    """A prompt that extends one already run (by more than a window) hits the prefix cache with the pool too, and
    gives the bits of the full caches."""
    pooled, full = both
    base = "The lighthouse keeper climbed the spiral stairs every evening at dusk. " * 3
    longer = [base + "Then the storm came in from the west.", base + "The lamp was lit."]
    for engine in both:
        _run(engine, [base], details=False)
    got, want = _run(pooled, longer, details=False), _run(full, longer, details=False)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert all(g[3] > 16 for g in got)  # the hits reach past the 8-token window


# --- Gemma 3 270M, the real weights as served (Q4_K_M, float16 KV cache, 128-token blocks, a 512-token window) ---

_PARA = ("The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker opened his shutters, and "
         "children ran along the towpath toward the old stone bridge, where a heron stood motionless in the shallows. ")
REAL_PROMPTS = [_PARA * 18 + "The heron", _PARA * 9 + "Then", "The capital of France is"]  # 795, ~400, 6 tokens


@pytest.mark.slow
def test_gemma3_270m_with_the_pool_gives_the_full_caches_bits(gemma3_270m_q4_dir):
    """Three prompts together, the longest past the window, 64 greedy steps each (the longest reaches 859
    positions: its first blocks slide out of the local layers' window and are taken again): ids, logprobs and
    prompt logprobs equal to the bit with and without the window pool."""
    from dataclasses import replace

    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig
    from backends.types import RequestParams

    config = EngineConfig(max_seq_len=1024, max_input_tokens=960, max_batch_size=4, max_iter_times=64,
                          block_size=128, kernels="aot", threads=2, kv_cache_dtype="float16")
    params = RequestParams(max_new_tokens=64, do_sample=False, ignore_eos=True, decoder_input_details=True)
    runs = []
    for pool in (True, False):
        engine = Engine(gemma3_270m_q4_dir, replace(config, window_pool=pool)).start()
        with engine:
            assert (engine.runner.window_blocks > 0) == pool
            handles = [engine.submit(p, params) for p in REAL_PROMPTS]
            runs.append([h.result(timeout=600) for h in handles])
    for got, want in zip(*runs):
        assert got.prompt_tokens == want.prompt_tokens
        assert [t.id for t in got.tokens] == [t.id for t in want.tokens]
        assert [t.logprob for t in got.tokens] == [t.logprob for t in want.tokens]
        assert [t.logprob for t in got.prefill] == [t.logprob for t in want.prefill]
    assert runs[0][0].prompt_tokens > 700
