"""A random workload through the scheduler and the hand-computable FakeRunner: shared
prefixes, n > 1 groups, chunked prefill, a tiny pool, preemption and random aborts, with
steps in turn or overlapped, with and without the prefix cache's host tier (and a disk tier
behind it)."""

from __future__ import annotations

import random

import pytest
from fake_runner import check_invariants, check_invariants_during_step, reference_output
from test_scheduler import assert_all_free, make, make_request


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "prefix,tier,disk", [(True, 0, 0), (True, 5, 0), (True, 2, 8), (False, 0, 0)]
)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_stress(mode, seed, prefix, tier, disk, overlap):
    """Shared prefixes, n > 1 groups, chunked prefill, a tiny pool and random aborts, with
    steps run in turn or overlapped as the engine runs them (update of step k-1 after step k
    is planned and dispatched; aborts land between the two): every step keeps the
    invariants, every surviving request matches the reference, every block comes back."""
    rng = random.Random(seed)
    sched, runner = make(
        num_blocks=14,
        block_size=4,
        max_num_seqs=5,
        budget=12,
        max_model_len=48,
        mode=mode,
        prefix=prefix,
        num_host_blocks=6 if mode == "swap" else 0,
        num_tier_blocks=tier,
        num_disk_blocks=disk,
    )
    systems = [[rng.randrange(1, 900) for _ in range(rng.choice([4, 6, 9]))] for _ in range(2)]
    expected = {}
    aborted = set()
    pending = []
    everyone = []
    for i in range(14):
        prompt = rng.choice(systems) + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 8))]
        max_tokens = rng.randrange(1, 14)
        n = rng.choice([1, 1, 2, 3])
        for j in range(n):
            r = make_request(f"r{i}-{j}", prompt, max_tokens=max_tokens)
            if n > 1:
                r.parent_id, r.sample_index = f"r{i}", j
            pending.append((rng.randrange(0, 30), r))
            everyone.append(r)
            expected[r.request_id] = reference_output(prompt, max_tokens)
    pending.sort(key=lambda x: x[0])
    done: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    in_flight = None

    def finish(plan, res):
        for u in sched.update(plan, runner.collect(res)):
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finished:
                done[u.request_id] = tokens.pop(u.request_id)
        check_invariants(sched)

    t = 0
    while pending or sched.has_unfinished_requests() or in_flight is not None:
        while pending and pending[0][0] <= t:
            sched.add_request(pending.pop(0)[1])
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            assert sched.abort(rid)
            aborted.add(rid)
        out = sched.schedule()
        check_invariants_during_step(sched, out)
        res = runner.dispatch(out)
        if overlap:
            if in_flight is not None:
                finish(*in_flight)
            in_flight = (out, res) if out.seqs else None
        else:
            finish(out, res)
        t += 1
        assert t < 2000
    assert set(done) | aborted == set(expected)
    for rid, toks in done.items():
        assert toks == expected[rid], rid
    assert sched.stats.num_preemptions > 0
    num_copies = sum(len(o.blocks_to_copy) for o in runner.steps)
    if prefix:
        assert sched.stats.prefix_cache_hits > 0
    else:  # only n > 1 forks share: each fork reuses all but the last prompt token
        assert sched.stats.prefix_cache_hits == sum(r.num_cached_tokens for r in everyone)
        for r in everyone:
            assert r.num_cached_tokens in (0, r.num_prompt_tokens - 1)
            assert r.parent_id is not None or r.num_cached_tokens == 0
        assert num_copies >= sum(1 for r in everyone if r.num_cached_tokens)  # one per fork
    if mode == "swap":
        assert sched.stats.num_swap_outs > 0
    if tier:
        assert sched.stats.kv_offload_blocks_stored > 0
        assert len(sched.pool.tier) <= tier
    if disk:
        assert sched.stats.kv_offload_disk_blocks_stored > 0
        assert len(sched.pool.disk) <= disk
    assert_all_free(sched)
