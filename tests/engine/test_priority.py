"""Priority scheduling (``scheduling_policy="priority"``, vLLM's) against the hand-computable
FakeRunner: lower priority values are admitted first (arrival breaks ties), preemption takes
the lowest priority first, and a steady stream of higher-priority requests starves a lower
one until the stream ends (no aging, as vLLM). The fcfs policy refuses priorities."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, make_request, reference_output, run
from test_scheduler import assert_all_free

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.sched.scheduler import Scheduler


def _make(policy="priority", *, num_blocks=64, max_num_seqs=8, mode="recompute"):
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=128,
            preemption_mode=mode, scheduling_policy=policy,
        ),
        CacheConfig(block_size=4),
        num_blocks=num_blocks,
        num_host_blocks=num_blocks if mode == "swap" else 0,
    )  # fmt: skip
    return sched, FakeRunner(num_blocks, 4, sched.pool.num_host_blocks, scheduler=sched)


def _first_steps(sched, runner) -> tuple[dict[str, int], dict]:
    """The step at which each request was first scheduled, and the outputs."""
    first: dict[str, int] = {}
    step = {"n": 0}

    def on_step(plan, _):
        for s in plan.seqs:
            first.setdefault(s.request_id, step["n"])
        step["n"] += 1

    done = run(sched, runner, on_step=on_step)
    return first, done


def test_lower_priority_value_is_admitted_first_then_arrival():
    sched, runner = _make(max_num_seqs=1)
    prompts = {"late-urgent": [1, 2], "a": [3, 4], "b": [5, 6], "urgent": [7, 8]}
    prio = {"late-urgent": -1, "a": 5, "b": 5, "urgent": -1}
    for rid in ("a", "b", "urgent", "late-urgent"):
        sched.add_request(make_request(rid, prompts[rid], max_tokens=2, priority=prio[rid]))
    first, done = _first_steps(sched, runner)
    assert sorted(first, key=first.get) == ["urgent", "late-urgent", "a", "b"]
    assert done == {rid: reference_output(p, 2) for rid, p in prompts.items()}
    assert_all_free(sched)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_takes_the_lowest_priority_first(mode):
    # 6 blocks of 4 tokens; three requests that each grow to 16 tokens: someone is preempted.
    # "low" arrived first, so fcfs would keep it; the priority policy preempts it first.
    sched, runner = _make(num_blocks=6, mode=mode)
    prompts = {"low": [1, 2, 3, 4, 5], "mid": [6, 7, 8, 9], "high": [10, 11, 12]}
    prio = {"low": 9, "mid": 1, "high": 0}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=16 - len(p) + 1, priority=prio[rid]))
    preempted: list[str] = []
    done = run(sched, runner, on_step=lambda plan, _: preempted.extend(plan.preempted_request_ids))
    assert preempted and preempted[0] == "low"
    assert "high" not in preempted
    assert done == {rid: reference_output(p, 16 - len(p) + 1) for rid, p in prompts.items()}
    assert_all_free(sched)


def test_a_stream_of_higher_priority_requests_starves_a_lower_one_until_it_ends():
    """One running slot; a low-priority request waits while higher-priority ones keep
    arriving (one new each step), and runs once they stop: no aging."""
    sched, runner = _make(max_num_seqs=1)
    sched.add_request(make_request("low", [1, 2], max_tokens=2, priority=1))
    sched.add_request(make_request("hi-0", [3, 4], max_tokens=2, priority=0))
    order: list[str] = []
    arrivals = iter(range(1, 8))

    def on_step(plan, _):
        for s in plan.seqs:
            if s.request_id not in order:
                order.append(s.request_id)
        k = next(arrivals, None)
        if k is not None:
            sched.add_request(make_request(f"hi-{k}", [3, 4 + k], max_tokens=2, priority=0))

    done = run(sched, runner, on_step=on_step)
    assert order == [f"hi-{k}" for k in range(8)] + ["low"]
    assert done["low"] == reference_output([1, 2], 2)
    assert_all_free(sched)


def test_fcfs_refuses_priorities_and_configs_check_the_policy():
    sched, _ = _make("fcfs")
    with pytest.raises(ValueError, match="scheduling_policy 'priority'"):
        sched.add_request(make_request("a", [1], priority=3))
    sched.add_request(make_request("b", [1], priority=0))
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="priority must be an int"):
        make_request("c", [1], priority=1.5)
