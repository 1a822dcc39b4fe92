"""The prefix cache's host tier on the scheduler side, by hand and against the FakeRunner.

The FakeRunner keeps token ids (and positions) in its device pool and in its host tier and
checks, at every step, that each sequence reads exactly its own tokens back: a block offloaded
late, loaded into the wrong block or read before its load fails there, or changes the output
that the tests compare with the cache-free reference."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, make_request, reference_output, run

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.sched.block_pool import BlockPool, hash_block_tokens
from jaxpaged.sched.host_tier import HostTier
from jaxpaged.sched.scheduler import Scheduler


def test_host_tier_lru_by_hand():
    tier = HostTier(2)
    assert tier.put(b"a") == 0 and tier.put(b"b") == 1
    tier.touch(b"a")  # b is now the least recently used
    assert tier.put(b"c") == 1 and tier.keys() == [b"a", b"c"] and tier.num_evictions == 1
    tier.pin(b"a")
    tier.pin(b"c")
    assert tier.put(b"d") is None  # every key pinned: no room, nothing forgotten
    assert len(tier) == 2
    tier.unpin_all()
    assert tier.put(b"d") == 0 and tier.keys() == [b"c", b"d"]  # a was pinned first: LRU
    tier.clear()
    assert len(tier) == 0 and tier.put(b"e") in (0, 1)
    with pytest.raises(ValueError, match="already held"):
        tier.put(b"e")
    assert HostTier(0).put(b"x") is None
    with pytest.raises(ValueError, match="num_slots"):
        HostTier(-1)


def test_block_pool_offloads_on_eviction_and_loads_on_hit():
    """3 blocks of 2 tokens, a tier of 1: a's two registered blocks are freed tail first, b's
    second block evicts a's tail (block 1) to tier slot 0; c, whose prefix is a's, gets
    block 0 from the device and a's tail loaded from slot 0 into a fresh block."""
    pool = BlockPool(3, 2, num_tier_blocks=1)
    a = [1, 2, 3, 4]
    assert pool.allocate_slots("a", 0, 4) == []
    pool.register_computed("a", 4, 4, lambda i, j: a[i:j])
    assert pool.block_table("a") == (0, 1)
    pool.free("a")  # free cached, least recently freed first: 1, then 0
    assert pool.allocate_slots("b", 0, 4) == [] and pool.block_table("b") == (2, 1)
    assert pool.take_tier_moves() == ([(1, 0)], [], [], [])
    key1 = hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])
    assert pool.tier.keys() == [key1]
    c = [1, 2, 3, 4, 9]
    prefix = pool.find_prefix("c", 5, lambda i, j: c[i:j])
    assert prefix == [0, key1]  # block 0 still on the device, block 1 only in the tier
    assert not pool.can_allocate("c", 0, 1, prefix)  # 3 blocks needed, block 0 alone free
    pool.free("b")  # unregistered: free uncached, 1 then 2 (a stack)
    assert pool.allocate_slots("c", 0, 1, prefix) == []
    assert pool.block_table("c") == (0, 2, 1)
    assert pool.take_tier_moves() == ([], [(0, 2)], [], [])
    assert pool.find_prefix("d", 5, lambda i, j: c[i:j]) == [0, 2]  # registered at once
    pool.free("c")
    pool.free("d")
    assert pool.num_free_blocks == 3 and pool.tracked_request_ids() == set()
    pool.reset_prefix_cache()
    assert len(pool.tier) == 0
    with pytest.raises(ValueError, match="needs prefix caching"):
        BlockPool(3, 2, enable_prefix_caching=False, num_tier_blocks=1)


def _make(num_tier_blocks, *, num_blocks=16, block_size=4, num_disk_blocks=0):
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        CacheConfig(block_size=block_size),
        num_blocks=num_blocks,
        num_tier_blocks=num_tier_blocks,
        num_disk_blocks=num_disk_blocks,
    )
    runner = FakeRunner(
        num_blocks,
        block_size,
        scheduler=sched,
        num_tier_blocks=num_tier_blocks,
        num_disk_blocks=num_disk_blocks,
    )
    return sched, runner


def _replay(sched, runner, *, turns=4, convs=3, overlap=False):
    """Multi-turn agent replay: each round sends every conversation's whole history plus a
    new user message (6 tokens), 4 tokens out. Returns every turn's output."""
    history = {c: [100 * (c + 1) + i for i in range(10)] for c in range(convs)}
    outputs = {}
    for t in range(turns):
        for c in range(convs):
            sched.add_request(make_request(f"c{c}t{t}", history[c], max_tokens=4))
        done = run(sched, runner, overlap=overlap)
        for c in range(convs):
            out = done[f"c{c}t{t}"]
            assert out == reference_output(history[c], 4), f"c{c}t{t}"
            outputs[f"c{c}t{t}"] = out
            history[c] = history[c] + out + [7 * t + c + i for i in range(6)]
    return outputs


def _assert_nothing_held(sched, capacity):
    pool = sched.pool
    assert not sched.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks and pool.tracked_request_ids() == set()
    slots = [pool.tier.slot(k) for k in pool.tier.keys()]
    assert len(slots) == len(set(slots)) <= capacity and all(0 <= s < capacity for s in slots)


@pytest.mark.parametrize("overlap", [False, True])
def test_multi_turn_replay_over_the_pool_hits_the_tier(overlap):
    """Three conversations of 4 turns need ~30 blocks of history; the device pool has 16.
    With the tier, later turns load their evicted prefixes back (each checked token by
    token by the FakeRunner) and compute fewer tokens than without; outputs are the
    reference's either way."""
    computed = {}
    for tier in (0, 64):
        sched, runner = _make(tier)
        fed = []
        _replay_out = _replay(sched, runner, overlap=overlap)
        assert len(_replay_out) == 12
        fed = sum(s.num_tokens for plan in runner.steps for s in plan.seqs)
        computed[tier] = fed
        st = sched.stats
        if tier:
            assert st.kv_offload_hits > 0 and st.kv_offload_blocks_loaded > 0
            assert st.kv_offload_blocks_stored > 0
            assert st.kv_offload_hits == st.kv_offload_blocks_loaded * 4
            loads = sum(len(p.blocks_to_load) for p in runner.steps)
            assert loads == st.kv_offload_blocks_loaded
            _assert_nothing_held(sched, tier)
        else:
            assert st.kv_offload_hits == st.kv_offload_blocks_stored == 0
            assert all(not p.blocks_to_offload and not p.blocks_to_load for p in runner.steps)
    assert computed[64] < computed[0]


def test_tier_is_bounded_and_least_recently_used_goes():
    """A tier of 4 blocks never maps more than 4 keys (the runner's slots stay < 4), forgets
    the least recently used, and outputs stay exact."""
    sched, runner = _make(4)
    _replay(sched, runner)
    assert len(sched.pool.tier) == 4 and sched.pool.tier.num_evictions > 0
    assert all(s < 4 for p in runner.steps for _, s in p.blocks_to_offload)
    _assert_nothing_held(sched, 4)


@pytest.mark.parametrize("overlap", [False, True])
def test_disk_tier_behind_a_small_host_tier(overlap):
    """A 3-block host tier spills what it forgets to a 64-block disk tier; later turns load
    from both (the FakeRunner checks every block's tokens), outputs stay the reference's,
    and the prompt tokens computed drop below those of the host tier alone."""
    computed = {}
    for disk in (0, 64):
        sched, runner = _make(3, num_disk_blocks=disk)
        _replay(sched, runner, overlap=overlap)
        computed[disk] = sum(s.num_tokens for plan in runner.steps for s in plan.seqs)
        st = sched.stats
        if disk:
            assert st.kv_offload_disk_blocks_stored > 0 and st.kv_offload_disk_blocks_loaded > 0
            assert st.kv_offload_blocks_loaded > st.kv_offload_disk_blocks_loaded  # both tiers
            assert len(sched.pool.disk) <= disk
        _assert_nothing_held(sched, 3)
    assert computed[64] < computed[0]


def test_abort_with_loads_in_flight_leaks_nothing():
    """Requests aborted right after the plan that loads their prefix (and one still
    waiting) give every block back; the tier keeps its keys."""
    sched, runner = _make(64)
    _replay(sched, runner, turns=3)
    hist = [100 + i for i in range(40)]
    sched.add_request(make_request("x", hist, max_tokens=4))
    run(sched, runner)  # x's blocks cached; y's turn below evicts some of them
    for i in range(3):
        sched.add_request(make_request(f"y{i}", [900 + 10 * i + j for j in range(40)], 4))
    run(sched, runner)
    sched.add_request(make_request("x2", hist + [5, 6, 7, 8], max_tokens=4))
    sched.add_request(make_request("z", [1] * 50, max_tokens=4))
    plan = sched.schedule()
    assert plan.blocks_to_load  # x2's prefix comes back from the tier
    runner.execute(plan)
    assert sched.abort("x2") and sched.abort("z")
    assert sched.schedule().finished_request_ids
    _assert_nothing_held(sched, 64)
    assert len(sched.pool.tier) > 0
