"""Scheduler scenarios against the hand-computable FakeRunner (no model, fast)."""

from __future__ import annotations

import pytest
from fake_runner import (
    FakeRunner,
    check_invariants,
    check_invariants_during_step,
    make_request,
    next_token,
    reference_output,
    run,
)

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.outputs import Logprob
from jaxpaged.sched.request import RequestStatus
from jaxpaged.sched.scheduler import RunnerOutput, Scheduler


def make(
    num_blocks=64,
    *,
    block_size=4,
    max_num_seqs=8,
    budget=64,
    max_model_len=256,
    mode="recompute",
    prefix=True,
    num_host_blocks=None,
    num_tier_blocks=0,
    num_disk_blocks=0,
):
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            preemption_mode=mode,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix),
        num_blocks=num_blocks,
        num_host_blocks=(num_blocks if mode == "swap" else 0)
        if num_host_blocks is None
        else num_host_blocks,
        num_tier_blocks=num_tier_blocks,
        num_disk_blocks=num_disk_blocks,
    )
    runner = FakeRunner(
        num_blocks,
        block_size,
        sched.pool.num_host_blocks,
        scheduler=sched,
        num_tier_blocks=num_tier_blocks,
        num_disk_blocks=num_disk_blocks,
    )
    return sched, runner


def step(sched, runner):
    out = sched.schedule()
    check_invariants_during_step(sched, out)
    updates = sched.update(out, runner.execute(out))
    check_invariants(sched)
    return out, updates


def assert_all_free(sched):
    pool = sched.pool
    assert not sched.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.num_free_host_blocks + len(pool.host._pending) == pool.num_host_blocks
    pool.release_host_slots()
    assert pool.num_free_host_blocks == pool.num_host_blocks
    assert pool.tracked_request_ids() == set()  # no request id left behind


def test_fake_model_by_hand():
    # [1,2,3] -> 6+3 = 9; [1,2,3,9] -> 15+4 = 19; -> 34+5 = 39; -> 73+6 = 79
    assert next_token([1, 2, 3]) == 9
    assert reference_output([1, 2, 3], 4) == [9, 19, 39, 79]
    sched, runner = make()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    assert run(sched, runner) == {"a": [9, 19, 39, 79]}
    assert_all_free(sched)


def test_single_request_lifecycle_and_times():
    ticks = iter(range(100))
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64),
        CacheConfig(block_size=4),
        num_blocks=16,
        clock=lambda: float(next(ticks)),
    )
    runner = FakeRunner(16, 4, scheduler=sched)
    req = make_request("a", [5, 6, 7, 8, 9], max_tokens=3)
    sched.add_request(req)
    out, ups = step(sched, runner)
    assert [(s.start_pos, s.token_ids, s.do_sample) for s in out.seqs] == [
        (0, (5, 6, 7, 8, 9), True)
    ]
    assert ups[0].new_token_ids == (next_token([5, 6, 7, 8, 9]),) and not ups[0].finished
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 5
    assert req.first_token_time is not None
    out, _ = step(sched, runner)
    assert out.seqs[0].token_ids == (req.output_token_ids[0],) and out.seqs[0].start_pos == 5
    out, ups = step(sched, runner)
    assert ups[0].finished and req.status is RequestStatus.FINISHED_LENGTH
    assert req.finish_reason == "length" and req.finish_time > req.first_token_time
    assert req.output_token_ids == reference_output([5, 6, 7, 8, 9], 3)
    assert sched.schedule().finished_request_ids == ("a",)
    assert_all_free(sched)


def test_continuous_batching_admits_the_step_after_a_finish():
    sched, runner = make(max_num_seqs=2)
    sched.add_request(make_request("a", [1, 2], max_tokens=2))
    sched.add_request(make_request("b", [3, 4], max_tokens=5))
    sched.add_request(make_request("c", [5, 6], max_tokens=2))
    ids = []
    finished_at = {}
    for i in range(8):
        out, ups = step(sched, runner)
        ids.append([s.request_id for s in out.seqs])
        for u in ups:
            if u.finished:
                finished_at[u.request_id] = i
    assert finished_at["a"] == 1
    assert ids[0] == ["a", "b"] and ids[1] == ["a", "b"]
    assert ids[2] == ["b", "c"]  # c joins right after a leaves
    assert not sched.has_unfinished_requests()
    assert_all_free(sched)


def test_token_budget_and_max_num_seqs():
    sched, runner = make(num_blocks=200, max_num_seqs=3, budget=10)
    prompts = {f"r{i}": [i + 1] * (3 + 2 * i) for i in range(7)}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=4))
    steps = []
    done = run(sched, runner, on_step=lambda out, ups: steps.append(out))
    assert all(s.num_batched_tokens <= 10 for s in steps)
    assert all(s.num_seqs <= 3 for s in steps)
    assert max(s.num_seqs for s in steps) == 3
    assert steps[0].num_batched_tokens == 10  # r0 (3) + r1 (5) + 2 tokens of r2
    assert [s.num_tokens for s in steps[0].seqs] == [3, 5, 2]
    assert done == {rid: reference_output(p, 4) for rid, p in prompts.items()}
    assert_all_free(sched)


def test_chunked_prefill_splits_a_long_prompt():
    sched, runner = make(budget=8)
    prompt = list(range(10, 33))  # 23 tokens
    sched.add_request(make_request("a", prompt, max_tokens=3))
    chunks = []
    for _ in range(3):
        out, ups = step(sched, runner)
        (s,) = out.seqs
        chunks.append((s.start_pos, s.token_ids, s.do_sample))
    assert chunks == [
        (0, tuple(prompt[0:8]), False),
        (8, tuple(prompt[8:16]), False),
        (16, tuple(prompt[16:23]), True),
    ]
    assert ups[0].new_token_ids == (next_token(prompt),)
    done = run(sched, runner)
    assert done == {"a": reference_output(prompt, 3)}
    assert_all_free(sched)


def test_decodes_first_and_prefill_rides_in_the_same_step():
    sched, runner = make(budget=8)
    sched.add_request(make_request("short", [1, 2], max_tokens=6))
    sched.add_request(make_request("long", list(range(1, 21)), max_tokens=2))
    out, _ = step(sched, runner)
    assert [(s.request_id, s.num_tokens) for s in out.seqs] == [("short", 2), ("long", 6)]
    out, _ = step(sched, runner)
    # decode of "short" first, then 7 more tokens of the long prompt
    assert [(s.request_id, s.start_pos, s.num_tokens, s.do_sample) for s in out.seqs] == [
        ("short", 2, 1, True),
        ("long", 6, 7, False),
    ]
    done = run(sched, runner)
    assert done["short"] == reference_output([1, 2], 6)
    assert done["long"] == reference_output(list(range(1, 21)), 2)
    assert_all_free(sched)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_pool(mode, overlap):
    # 6 blocks of 4 = 24 slots; three requests that each grow to 16 tokens.
    sched, runner = make(num_blocks=6, mode=mode, budget=32)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8, 9], "c": [10, 11, 12]}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=16 - len(p) + 1))
    preempted = []
    resumed = []

    def on_step(out, ups):
        preempted.extend(out.preempted_request_ids)
        for s in out.seqs:
            if s.request_id in preempted and s.start_pos == 0:
                resumed.append((s.request_id, s.token_ids))

    done = run(sched, runner, on_step=on_step, overlap=overlap)
    assert sched.stats.num_preemptions > 0
    # the victim is the latest arrival still running
    assert preempted[0] == "c"
    assert done == {rid: reference_output(p, 16 - len(p) + 1) for rid, p in prompts.items()}
    if mode == "recompute":
        assert sched.stats.num_swap_outs == 0
        # the resumed request prefills prompt + the output it had before preemption
        rid, toks = resumed[0]
        assert len(toks) > len(prompts[rid])
        assert list(toks[: len(prompts[rid])]) == prompts[rid]
    else:
        assert sched.stats.num_swap_outs == sched.stats.num_preemptions
        assert any(o.blocks_to_swap_out for o in runner.steps)
        assert any(o.blocks_to_swap_in for o in runner.steps)
        assert not resumed  # swapped requests resume where they were
    assert_all_free(sched)


def test_swap_restores_identical_blocks():
    sched, runner = make(num_blocks=5, mode="swap", budget=32)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=12))
    sched.add_request(make_request("b", [7, 8, 9, 10, 11, 12, 13], max_tokens=12))
    snapshot = {}  # host slot -> computed content of the device block it came from
    restored = 0
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        dev_of = {h: d for d, h in out.blocks_to_swap_out}
        for rid in out.preempted_request_ids:
            victim = sched.get_request(rid)
            assert victim.status is RequestStatus.SWAPPED
            n = victim.num_computed_tokens
            for i, h in enumerate(sched.pool.host_block_table(rid)):
                valid = min(4, n - 4 * i)
                snapshot[h] = runner.dev_tok[dev_of[h], :valid].copy()
        res = runner.execute(out)
        for host, dev in out.blocks_to_swap_in:
            valid = len(snapshot[host])
            assert (runner.dev_tok[dev, :valid] == snapshot.pop(host)).all()
            restored += 1
        sched.update(out, res)
        check_invariants(sched)
    assert restored > 0 and not snapshot
    assert_all_free(sched)


def test_swap_falls_back_to_recompute_when_host_space_is_full():
    sched, runner = make(num_blocks=6, mode="swap", num_host_blocks=1, budget=32)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8, 9], "c": [10, 11, 12]}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=16 - len(p) + 1))
    done = run(sched, runner)
    assert sched.stats.num_preemptions > sched.stats.num_swap_outs
    assert done == {rid: reference_output(p, 16 - len(p) + 1) for rid, p in prompts.items()}
    assert_all_free(sched)


def test_swapped_requests_return_before_new_ones_are_admitted():
    sched, runner = make(num_blocks=6, mode="swap", budget=32)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=12))
    sched.add_request(make_request("b", [6, 7, 8, 9], max_tokens=12))
    while not sched.swapped:
        step(sched, runner)
    (out_req,) = sched.swapped
    sched.add_request(make_request("late", [3, 3], max_tokens=2))
    late_steps = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        ids = [s.request_id for s in out.seqs]
        if "late" in ids:
            late_steps += 1
            assert not sched.swapped  # nobody is left out on the host
            if out.blocks_to_swap_in:  # brought back in the same step: ahead of the new one
                assert ids.index(out_req.request_id) < ids.index("late")
    assert late_steps == 2 and sched.stats.num_swap_outs >= 1
    assert_all_free(sched)


def test_prefix_cache_hit_for_a_shared_system_prompt():
    system = list(range(100, 112))  # 12 tokens = 3 full blocks of 4
    sched, runner = make()
    sched.add_request(make_request("a", system + [1, 2], max_tokens=3))
    step(sched, runner)
    table_a = sched.pool.block_table("a")
    sched.add_request(make_request("b", system + [7], max_tokens=3))
    out, _ = step(sched, runner)
    sb = next(s for s in out.seqs if s.request_id == "b")
    assert sb.start_pos == 12 and sb.token_ids == (7,)
    b = sched.get_request("b")
    assert sched.pool.block_table("b")[:3] == table_a[:3] and b.num_cached_tokens == 12
    assert all(sched.pool.ref_count(x) == 2 for x in table_a[:3])
    assert sched.stats.prefix_cache_hits == 12
    assert sched.stats.prefix_cache_queries == 14 + 13
    done = run(sched, runner)
    assert done == {
        "a": reference_output(system + [1, 2], 3),
        "b": reference_output(system + [7], 3),
    }
    # freed cached blocks stay reusable: a later request with the same prefix hits them
    sched.add_request(make_request("c", system + [9, 9], max_tokens=2))
    out, _ = step(sched, runner)
    assert out.seqs[0].start_pos == 12
    assert run(sched, runner) == {"c": reference_output(system + [9, 9], 2)}
    assert_all_free(sched)


def test_prefix_hit_leaves_the_last_token_to_compute():
    sched, runner = make()
    prompt = list(range(1, 9))  # exactly 2 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=2))
    out, _ = step(sched, runner)
    # only block 0 may be reused: the last prompt token must run to produce logits
    assert (out.seqs[0].start_pos, out.seqs[0].token_ids) == (4, tuple(prompt[4:]))
    assert run(sched, runner)["b"] == reference_output(prompt, 2)
    assert_all_free(sched)


def test_prefix_caching_off_never_hits():
    system = list(range(100, 112))
    sched, runner = make(prefix=False)
    sched.add_request(make_request("a", system + [1], max_tokens=2))
    run(sched, runner)
    sched.add_request(make_request("b", system + [2], max_tokens=2))
    out, _ = step(sched, runner)
    assert out.seqs[0].start_pos == 0 and sched.stats.prefix_cache_hits == 0
    run(sched, runner)
    assert_all_free(sched)


@pytest.mark.parametrize("prompt_len", [10, 8])  # partial and full last block
def test_n_samples_fork_the_prompt_blocks(prompt_len):
    prompt = list(range(50, 50 + prompt_len))
    sched, runner = make()
    reqs = []
    for i in range(3):
        r = make_request(f"g-{i}", prompt, max_tokens=5)
        r.parent_id, r.sample_index = "g", i
        sched.add_request(r)
        reqs.append(r)
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.seqs] == ["g-0"]  # siblings wait for the prefill
    leader_table = list(sched.pool.block_table(reqs[0].request_id))
    out, _ = step(sched, runner)
    by_id = {s.request_id: s for s in out.seqs}
    assert set(by_id) == {"g-0", "g-1", "g-2"}
    for i in (1, 2):
        s = by_id[f"g-{i}"]
        # forked: only the last prompt token is recomputed, into a private copy
        assert (s.start_pos, s.token_ids, s.do_sample) == (prompt_len - 1, (prompt[-1],), True)
        # a new request's whole table crosses: the leader's blocks, a private last one
        assert (s.block_start, s.new_block_ids[:-1]) == (0, tuple(leader_table[:-1]))
        assert s.new_block_ids[-1] != leader_table[-1]
        assert runner.batch.block_table(s.request_id).tolist() == list(s.new_block_ids)
        assert reqs[i].num_cached_tokens == prompt_len - 1
    copies = out.blocks_to_copy
    assert len(copies) == 2 and all(src == leader_table[-1] for src, _ in copies)
    assert sched.stats.prefix_cache_hits == 2 * (prompt_len - 1)
    done = run(sched, runner)
    assert done == {f"g-{i}": reference_output(prompt, 5) for i in range(3)}
    assert_all_free(sched)


def test_copy_on_write_of_the_shared_partial_block_keeps_both_sequences_intact():
    prompt = [1, 2, 3, 4, 5, 6]  # last block holds 2 tokens
    sched, runner = make()
    for i in range(2):
        r = make_request(f"p-{i}", prompt, max_tokens=8)
        r.parent_id, r.sample_index = "p", i
        sched.add_request(r)
    step(sched, runner)  # p-0 prefills
    out, _ = step(sched, runner)  # p-0 decodes into its block, p-1 forks and copies it
    src, dst = out.blocks_to_copy[0]
    p0, p1 = sched.pool.block_table("p-0"), sched.pool.block_table("p-1")
    assert p0[1] == src and p1[1] == dst
    assert sched.pool.ref_count(src) == 1 and sched.pool.ref_count(dst) == 1
    assert p0[0] == p1[0] and sched.pool.ref_count(p0[0]) == 2
    done = run(sched, runner)  # the fake asserts every read of both sequences
    assert done["p-0"] == done["p-1"] == reference_output(prompt, 8)
    assert_all_free(sched)


def test_abort_in_waiting_running_and_swapped_states():
    sched, runner = make(num_blocks=6, mode="swap", budget=32, max_num_seqs=2)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=12))
    sched.add_request(make_request("b", [6, 7, 8, 9], max_tokens=12))
    sched.add_request(make_request("w", [1, 1], max_tokens=12))
    while not sched.swapped:
        step(sched, runner)
    swapped = sched.swapped[0]
    assert sched.pool.host_block_table(swapped.request_id)
    assert sched.abort(swapped.request_id)
    assert swapped.status is RequestStatus.FINISHED_ABORTED
    assert swapped.request_id not in sched.pool.tracked_request_ids()
    assert sched.get_request("w").status is RequestStatus.WAITING
    assert sched.abort("w")
    assert "w" not in sched.pool.tracked_request_ids()
    running = sched.running[0]
    assert sched.pool.block_table(running.request_id)
    assert sched.abort(running.request_id)
    assert running.finish_reason == "abort"
    assert running.request_id not in sched.pool.tracked_request_ids()
    assert not sched.abort(running.request_id) and not sched.abort("nope")
    out = sched.schedule()
    assert set(out.finished_request_ids) == {swapped.request_id, "w", running.request_id}
    assert not out.seqs
    check_invariants(sched)
    assert_all_free(sched)


def test_finished_aborted_and_recompute_preempted_requests_leave_no_pool_state():
    """The pool keys everything by request id: a request that ends or loses its blocks to a
    recompute preemption must leave no entry behind (an id can be reused later)."""
    sched, runner = make(num_blocks=6, budget=32)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8, 9], "c": [10, 11, 12], "d": [13, 14]}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=16 - len(p) + 1))
    preempted, finished = set(), set()
    for i in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        tracked = sched.pool.tracked_request_ids()
        for rid in out.preempted_request_ids:
            assert sched.get_request(rid).status is RequestStatus.WAITING
            assert rid not in tracked
            preempted.add(rid)
        finished |= set(out.finished_request_ids)
        assert not finished & tracked
        sched.update(out, runner.execute(out))
        check_invariants(sched)
        if i == 1:
            assert sched.get_request("d").status is RequestStatus.RUNNING
            assert sched.abort("d")
            assert "d" not in sched.pool.tracked_request_ids()
    finished |= set(sched.schedule().finished_request_ids)
    assert preempted and finished == set(prompts)
    assert_all_free(sched)


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched, runner = make()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    out = sched.schedule()
    res = runner.execute(out)
    sched.abort("a")
    assert sched.update(out, res) == []
    assert_all_free(sched)


def test_a_request_that_can_never_fit_is_rejected_at_add_time():
    sched, _ = make(num_blocks=4, max_model_len=64)  # 16 slots
    with pytest.raises(ValueError, match="needs up to 5 KV blocks"):
        sched.add_request(make_request("big", list(range(10)), max_tokens=10))
    sched.add_request(make_request("ok", list(range(10)), max_tokens=7))  # 16 slots
    with pytest.raises(ValueError, match="max_model_len - 1"):
        sched.add_request(make_request("long", list(range(64)), max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(make_request("over", list(range(60)), max_tokens=5))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", [1], max_tokens=1))


def test_stop_conditions():
    prompt = [4, 5, 6]
    ref = reference_output(prompt, 10)
    sched, runner = make()
    eos = ref[2]
    r = make_request("eos", prompt, max_tokens=10)
    r.eos_token_ids = (eos,)
    sched.add_request(r)
    r2 = make_request("ignore", prompt, max_tokens=10, ignore_eos=True)
    r2.eos_token_ids = (eos,)
    sched.add_request(r2)
    r3 = make_request("min", prompt, max_tokens=10, min_tokens=4, stop_token_ids=[ref[1], ref[5]])
    sched.add_request(r3)
    r4 = make_request("stopid", prompt, max_tokens=10, stop_token_ids=[ref[1]])
    sched.add_request(r4)
    r5 = make_request("ctx", prompt, max_tokens=None)
    sched.add_request(r5)
    done = run(sched, runner)
    assert done["eos"] == ref[:3] and r.finish_reason == "stop" and r.stop_reason is None
    assert done["ignore"] == ref[:10] and r2.finish_reason == "length"
    assert done["min"] == ref[:6] and r3.stop_reason == ref[5]
    assert done["stopid"] == ref[:2] and r4.stop_reason == ref[1]
    assert len(done["ctx"]) == 256 - 3 and r5.finish_reason == "length"
    assert done["ctx"] == reference_output(prompt, 253)
    assert_all_free(sched)


def test_finish_from_outside_for_stop_strings():
    sched, runner = make()
    sched.add_request(make_request("a", [1, 2], max_tokens=10))
    step(sched, runner)
    assert sched.finish("a", stop_reason="###")
    a_status = sched.schedule().finished_request_ids
    assert a_status == ("a",)
    assert not sched.finish("a")
    with pytest.raises(ValueError, match="FINISHED"):
        sched.finish("a", RequestStatus.RUNNING)
    assert_all_free(sched)


def test_update_checks_runner_output_alignment():
    sched, runner = make()
    sched.add_request(make_request("a", [1, 2], max_tokens=2))
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled_token_ids"):
        sched.update(out, RunnerOutput(sampled_token_ids=[1, 2]))


def test_logprobs_are_passed_through():
    sched, runner = make()
    sched.add_request(make_request("a", [1, 2], max_tokens=2, logprobs=1))
    out = sched.schedule()
    res = runner.execute(out)
    lp = Logprob(token_id=res.sampled_token_ids[0], logprob=-0.5, top={3: -0.1})
    ups = sched.update(out, RunnerOutput(sampled_token_ids=res.sampled_token_ids, logprobs=[lp]))
    assert ups[0].new_logprobs == (lp,)


def test_a_sequence_the_runner_could_not_batch_fails_alone():
    sched, runner = make()
    sched.add_request(make_request("bad", [1, 2], max_tokens=4))
    sched.add_request(make_request("good", [3, 4], max_tokens=4))
    out = sched.schedule()
    res = runner.execute(out)
    res = RunnerOutput(sampled_token_ids=res.sampled_token_ids, failed={"bad": "ValueError: x"})
    ups = {u.request_id: u for u in sched.update(out, res)}
    assert ups["bad"].finish_reason == "error" and ups["bad"].error == "ValueError: x"
    assert not ups["good"].finished and ups["good"].new_token_ids == (next_token([3, 4]),)
    assert run(sched, runner) == {"good": reference_output([3, 4], 4)}
    assert_all_free(sched)


def test_kv_cache_waste_and_usage_by_hand():
    sched, runner = make(num_blocks=10)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=4))  # 5 tokens: 2 blocks
    step(sched, runner)
    assert sched.kv_cache_usage() == pytest.approx(2 / 10)
    assert sched.kv_cache_waste() == pytest.approx(3 / 8)
    step(sched, runner)  # 6 computed
    assert sched.kv_cache_waste() == pytest.approx(2 / 8)


def test_budget_smaller_than_the_running_decodes_still_finishes_everything():
    sched, runner = make(max_num_seqs=4, budget=2)
    prompts = {f"r{i}": [i + 1, i + 2, i + 3] for i in range(4)}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=5))
    steps = []
    done = run(sched, runner, on_step=lambda out, ups: steps.append(out))
    assert all(o.num_batched_tokens <= 2 for o in steps)
    assert done == {rid: reference_output(p, 5) for rid, p in prompts.items()}
    assert_all_free(sched)


def test_n_samples_when_the_first_finishes_at_its_prefill():
    prompt = list(range(7, 17))  # 10 tokens: 2 full blocks + 2
    sched, runner = make()
    for i in range(3):
        r = make_request(f"g-{i}", prompt, max_tokens=1 if i == 0 else 4)
        r.parent_id, r.sample_index = "g", i
        sched.add_request(r)
    out, ups = step(sched, runner)
    assert [s.request_id for s in out.seqs] == ["g-0"] and ups[0].finished
    out, _ = step(sched, runner)
    # no sibling to fork from any more: g-1 starts from the cached full blocks, g-2 forks g-1
    assert [(s.request_id, s.start_pos) for s in out.seqs] == [("g-1", 8)]
    out, _ = step(sched, runner)
    assert [(s.request_id, s.start_pos, s.num_tokens) for s in out.seqs] == [
        ("g-1", 10, 1),
        ("g-2", 9, 1),
    ]
    done = run(sched, runner)
    assert done == {"g-1": reference_output(prompt, 4), "g-2": reference_output(prompt, 4)}
    assert_all_free(sched)
