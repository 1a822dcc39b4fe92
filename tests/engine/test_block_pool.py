"""BlockPool unit tests: ref counts, prefix keys and LRU eviction, copy-on-write, swap slots."""

from __future__ import annotations

import hashlib

import pytest

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.block_pool import BlockPool, hash_block_tokens
from jaxpaged.sched.request import Request


def req(tokens, rid="r"):
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams())


def alloc(pool, r, n, prefix=()):
    """allocate_slots for n tokens past r's computed ones, as the scheduler calls it."""
    return pool.allocate_slots(r.request_id, r.num_computed_tokens, n, prefix)


def register(pool, r):
    pool.register_computed(r.request_id, r.num_computed_tokens, r.num_tokens, r.token_ids_slice)


def find(pool, r):
    return pool.find_prefix(r.request_id, r.num_tokens, r.token_ids_slice)


def probe(pool, tokens):
    """find_prefix for a throwaway request; its memoised keys are dropped after."""
    r = req(tokens, "probe")
    try:
        return find(pool, r)
    finally:
        pool.free(r.request_id)


def table(pool, r):
    return list(pool.block_table(r.request_id))


def host_table(pool, r):
    return list(pool.host_block_table(r.request_id))


def computed(pool, r, n):
    """Allocate and 'compute' n more tokens of r, as the scheduler would."""
    copies = alloc(pool, r, n)
    assert copies is not None
    r.num_computed_tokens += n
    register(pool, r)
    return copies


def test_hash_is_chained_sha256_of_parent_and_tokens():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4]) and len(h0) == 32
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    # same block content after a different prefix is a different key
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8]
    )
    # independent recomputation of the documented formula
    import array

    expect = hashlib.sha256(h0)
    expect.update(array.array("q", [5, 6, 7, 8]).tobytes())
    assert hash_block_tokens(h0, [5, 6, 7, 8]) == expect.digest()


def test_allocate_grows_block_by_block_and_free_returns_everything():
    pool = BlockPool(8, 4)
    r = req(range(10))
    assert alloc(pool, r, 3) == []
    assert pool.num_blocks_of("r") == 1 and pool.num_free_blocks == 7
    r.num_computed_tokens = 3
    assert alloc(pool, r, 1) == [] and pool.num_blocks_of("r") == 1  # fits in block 0
    r.num_computed_tokens = 4
    assert alloc(pool, r, 6) == [] and pool.num_blocks_of("r") == 3
    assert pool.block_table("r") == tuple(pool.req_to_blocks["r"])
    assert pool.num_used_blocks == 3 and pool.usage == pytest.approx(3 / 8)
    pool.free("r")
    assert table(pool, r) == [] and pool.num_free_blocks == 8
    assert pool.tracked_request_ids() == set()


def test_allocation_fails_atomically_when_short():
    pool = BlockPool(2, 4)
    r = req(range(12))
    assert not pool.can_allocate("r", 0, 12)
    assert alloc(pool, r, 12) is None
    assert table(pool, r) == [] and pool.num_free_blocks == 2
    assert pool.tracked_request_ids() == set()  # a failed allocation leaves no entry
    with pytest.raises(RuntimeError, match="freed more often"):
        pool._decref(0)


def test_prefix_hits_only_full_computed_blocks_and_not_the_last_token():
    pool = BlockPool(16, 4)
    a = req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    computed(pool, a, 10)  # blocks: [1..4] [5..8] [9,10] (partial: not registered)
    assert pool.num_cached_blocks == 2
    b = req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "b")
    assert find(pool, b) == table(pool, a)[:2]
    c = req([1, 2, 3, 4, 5, 6, 7, 8], "c")  # the whole prompt is cached: keep the last token
    assert find(pool, c) == table(pool, a)[:1]
    d = req([1, 2, 3, 4, 0, 6, 7, 8, 9], "d")
    assert find(pool, d) == table(pool, a)[:1]
    assert probe(pool, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == []
    hit = find(pool, b)
    assert alloc(pool, b, 3, hit) == []
    assert table(pool, b)[:2] == table(pool, a)[:2] and pool.num_blocks_of("b") == 3
    assert [pool.ref_count(x) for x in table(pool, a)] == [2, 2, 1]


def test_prefix_keeps_the_last_token_even_with_every_block_hash_memoised():
    """A request whose prompt fills its blocks exactly and whose hashes are all memoised (a
    fork copies its parent's) still leaves its last token to compute: a zero-token step
    would sample from nothing."""
    pool = BlockPool(16, 4)
    a = req(range(1, 9), "a")
    computed(pool, a, 8)  # two full blocks, both registered
    c = req(range(1, 9), "c")
    assert len(pool.block_hashes("c", 2, c.token_ids_slice)) == 2  # both memoised
    assert find(pool, c) == table(pool, a)[:1]


def test_freed_cached_blocks_are_reused_until_evicted_lru():
    pool = BlockPool(4, 2)
    a = req([1, 2, 3, 4, 5], "a")
    computed(pool, a, 4)  # two full blocks, registered
    blocks_a = table(pool, a)
    pool.free("a")
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    # still findable after free
    assert probe(pool, [1, 2, 3, 4, 9]) == blocks_a
    # uncached free blocks are taken first
    x = req([7, 7, 7, 7], "x")
    alloc(pool, x, 4)
    assert not set(table(pool, x)) & set(blocks_a)
    assert pool.num_cached_blocks == 2
    # the next block evicts the least recently freed cached block: a's tail (freed first)
    y = req([8, 8], "y")
    alloc(pool, y, 2)
    assert table(pool, y) == [blocks_a[1]]
    assert probe(pool, [1, 2, 3, 4, 9]) == blocks_a[:1]
    assert not pool.is_cached(blocks_a[1])
    pool.free("x")
    pool.free("y")
    assert pool.num_free_blocks == 4


def test_hit_on_a_free_cached_block_takes_it_off_the_free_list():
    pool = BlockPool(3, 2)
    a = req([1, 2, 3], "a")
    computed(pool, a, 2)
    pool.free("a")
    b = req([1, 2, 3, 4, 5], "b")
    hit = find(pool, b)
    assert len(hit) == 1
    assert pool.blocks_needed("b", 0, 3, hit) == 3  # the hit block + 2 new
    assert alloc(pool, b, 3, hit) == []
    assert pool.num_free_blocks == 0 and pool.ref_count(hit[0]) == 1
    assert alloc(pool, req([0] * 2, "c"), 2) is None
    pool.free("b")
    assert pool.num_free_blocks == 3


def test_duplicate_content_keeps_the_first_block_as_the_key_holder():
    pool = BlockPool(8, 2)
    a, b = req([1, 2, 3], "a"), req([1, 2, 3], "b")
    computed(pool, a, 2)
    computed(pool, b, 2)
    assert pool.num_cached_blocks == 1
    assert probe(pool, [1, 2, 5]) == table(pool, a)[:1]
    pool.free("a")
    pool.free("b")
    assert pool.num_free_blocks == 8


def test_fork_shares_all_blocks_and_copy_on_write_splits_the_written_one():
    pool = BlockPool(8, 4)
    parent = req([1, 2, 3, 4, 5, 6], "p")
    computed(pool, parent, 6)
    child = req([1, 2, 3, 4, 5, 6], "c")
    pool.fork("p", "c", 6, parent.num_computed_tokens)
    assert table(pool, child) == table(pool, parent)
    assert [pool.ref_count(b) for b in table(pool, parent)] == [2, 2]
    # the child recomputes position 5 (in the shared partial block): it gets a copy
    child.num_computed_tokens = 5
    assert pool.blocks_needed("c", 5, 1) == 1
    copies = alloc(pool, child, 1)
    assert copies == [(table(pool, parent)[1], table(pool, child)[1])]
    assert table(pool, child)[0] == table(pool, parent)[0]
    assert [pool.ref_count(b) for b in table(pool, parent)] == [2, 1]
    assert pool.ref_count(table(pool, child)[1]) == 1
    # the parent now writes into its own block in place: no copy
    parent_table = table(pool, parent)
    assert alloc(pool, parent, 1) == [] and table(pool, parent) == parent_table
    pool.free("p")
    pool.free("c")
    assert pool.num_free_blocks == 8


def test_fork_refuses_uncomputed_tokens_and_a_busy_child():
    pool = BlockPool(8, 4)
    parent = req([1, 2, 3, 4, 5], "p")
    computed(pool, parent, 3)
    with pytest.raises(ValueError, match="computed 3"):
        pool.fork("p", "c", 5, parent.num_computed_tokens)
    busy = req([1, 2], "busy")
    alloc(pool, busy, 2)
    with pytest.raises(ValueError, match="already holds"):
        pool.fork("p", "busy", 3, parent.num_computed_tokens)


def test_rewriting_a_private_cached_block_drops_its_key():
    pool = BlockPool(8, 2)
    a = req([1, 2, 3], "a")
    computed(pool, a, 2)
    assert pool.is_cached(table(pool, a)[0])
    a.num_computed_tokens = 1  # as a fork whose donor has gone: position 1 is rewritten
    assert alloc(pool, a, 1) == []
    assert not pool.is_cached(table(pool, a)[0]) and pool.num_cached_blocks == 0
    a.num_computed_tokens = 2
    register(pool, a)
    assert pool.is_cached(table(pool, a)[0])
    pool.free("a")


def test_swap_out_and_in_pairs_and_host_slot_accounting():
    pool = BlockPool(4, 2, num_host_blocks=3)
    r = req([1, 2, 3, 4, 5], "r")
    computed(pool, r, 5)  # 3 blocks
    dev = table(pool, r)
    assert pool.can_swap_out("r")
    out = pool.swap_out("r")
    assert [d for d, _ in out] == dev and len({h for _, h in out}) == 3
    assert table(pool, r) == [] and host_table(pool, r) == [h for _, h in out]
    assert pool.num_free_blocks == 4 and pool.num_free_host_blocks == 0
    other = req([9] * 8, "o")
    alloc(pool, other, 8)  # the device blocks are reusable at once
    assert not pool.can_swap_in("r", 5, 1)
    pool.free("o")
    assert pool.can_swap_in("r", 5, 1)  # 5 computed + 1 new = 3 blocks
    assert not pool.can_swap_in("r", 5, 4)  # 9 tokens = 5 blocks > 4
    host = host_table(pool, r)
    back = pool.swap_in("r")
    assert [h for h, _ in back] == host and [d for _, d in back] == table(pool, r)
    assert host_table(pool, r) == []
    # host slots come back only at the next release (no step reads and writes one slot)
    assert pool.num_free_host_blocks == 0
    pool.release_host_slots()
    assert pool.num_free_host_blocks == 3
    pool.free("r")
    assert pool.num_free_blocks == 4
    assert pool.tracked_request_ids() == set()


def test_swap_out_needs_room_and_free_host_returns_slots():
    pool = BlockPool(4, 2, num_host_blocks=1)
    r = req([1, 2, 3], "r")
    computed(pool, r, 3)
    assert not pool.can_swap_out("r")
    with pytest.raises(RuntimeError, match="host slots"):
        pool.swap_out("r")
    small = req([1], "s")
    computed(pool, small, 1)
    pool.swap_out("s")
    pool.free_host("s")
    assert pool.num_free_host_blocks == 1 and host_table(pool, small) == []
    pool.free("r")
    assert pool.num_free_blocks == 4
    assert pool.tracked_request_ids() == set()


def test_a_reused_request_id_starts_clean():
    """State is keyed by request id: after free / free_host nothing of a request is left, so
    a later request with the same id and other tokens gets its own keys, not the old ones."""
    pool = BlockPool(8, 2, num_host_blocks=4)
    old = req([1, 2, 3, 4, 5], "x")
    computed(pool, old, 5)  # memoises and registers the keys of [1, 2] [3, 4]
    pool.free("x")
    assert pool.tracked_request_ids() == set()
    new = req([1, 2, 7, 7, 7], "x")
    assert find(pool, new) == probe(pool, [1, 2, 7, 7, 7])
    assert len(find(pool, new)) == 1  # [1, 2] only; a stale key of [3, 4] would give 2
    computed(pool, new, 5)
    pool.swap_out("x")
    pool.free_host("x")
    assert pool.tracked_request_ids() == set()
    assert pool.num_free_blocks == 8 and pool.num_free_host_blocks == 4


def test_prefix_caching_disabled_and_reset():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    a = req([1, 2, 3], "a")
    computed(pool, a, 2)
    assert pool.num_cached_blocks == 0 and probe(pool, [1, 2, 3]) == []
    pool.free("a")
    pool2 = BlockPool(4, 2)
    b = req([1, 2, 3, 4, 5], "b")
    computed(pool2, b, 4)
    pool2.free("b")
    assert pool2.num_cached_blocks == 2
    pool2.reset_prefix_cache()
    assert pool2.num_cached_blocks == 0 and pool2.num_free_blocks == 4
    assert probe(pool2, [1, 2, 3, 4, 5]) == []


def test_constructor_validation():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        BlockPool(4, 4, num_host_blocks=-1)


def test_huge_pools_are_cheap_to_create():
    """Free lists are lazy: a tiny model with GiBs of swap space has millions of slots."""
    import time

    t0 = time.perf_counter()
    pool = BlockPool(1_000_000, 16, num_host_blocks=1_000_000_000)
    assert time.perf_counter() - t0 < 1.0
    assert pool.num_free_blocks == 1_000_000 and pool.num_free_host_blocks == 1_000_000_000
    r = req(range(40), "r")
    computed(pool, r, 40)
    assert table(pool, r) == [0, 1, 2]
    pool.swap_out("r")
    assert host_table(pool, r) == [0, 1, 2] and pool.num_free_host_blocks == 1_000_000_000 - 3
    pool.free_host("r")
    assert pool.num_free_host_blocks == 1_000_000_000 and pool.num_free_blocks == 1_000_000
