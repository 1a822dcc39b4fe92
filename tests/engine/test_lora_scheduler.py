"""The scheduler's side of multi-LoRA against the hand-computable FakeRunner: requests whose
adapter cannot get a device slot wait (others go ahead), slots are loaded once and reused,
outputs and block accounting stay exact, and prefix-cache keys include the adapter."""

from __future__ import annotations

from fake_runner import FakeRunner, make_request, reference_output, run

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.sched.scheduler import Scheduler


def _make(max_loras: int = 1):
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128),
        CacheConfig(block_size=4),
        num_blocks=64,
        num_host_blocks=0,
        max_loras=max_loras,
    )
    return sched, FakeRunner(64, 4, 0, scheduler=sched)


def _add(sched, rid, prompt, lora, max_tokens=4):
    req = make_request(rid, prompt, max_tokens=max_tokens)
    req.lora_name = lora
    sched.add_request(req)


def test_requests_wait_for_a_slot_and_slots_are_reused():
    sched, runner = _make(max_loras=1)
    prompts = {"a1": [1, 2, 3], "b1": [4, 5], "n1": [6, 7, 8], "a2": [9, 1]}
    loras = {"a1": "a", "b1": "b", "n1": None, "a2": "a"}
    for rid, prompt in prompts.items():
        _add(sched, rid, prompt, loras[rid])
    plans = []
    done = run(sched, runner, on_step=lambda plan, _: plans.append(plan))
    assert done == {rid: reference_output(p, 4) for rid, p in prompts.items()}
    first = plans[0]
    # b1 waits: the one slot is held by adapter a's requests; the others go ahead
    assert {d.request_id: d.lora_slot for d in first.new_requests} == {"a1": 1, "n1": 0, "a2": 1}
    assert first.lora_loads == ((1, "a"),)
    loads = [load for plan in plans for load in plan.lora_loads]
    assert loads == [(1, "a"), (1, "b")]  # a loaded once for both of its requests
    b_plan = next(p for p in plans if p.lora_loads == ((1, "b"),))
    assert [s.request_id for s in b_plan.seqs] == ["b1"]
    assert sched.pool.num_free_blocks == sched.pool.num_blocks
    assert sched.lora_slots.num_holders("b") == 0
    assert sched.lora_slots.resident == {"b": 1}  # idle, still loaded for a later request


def test_prefix_cache_keys_include_the_adapter():
    sched, runner = _make(max_loras=2)
    prompt = list(range(1, 14))  # three full blocks of 4 before the last token
    _add(sched, "first", prompt, "a", max_tokens=1)
    run(sched, runner)
    hits = []
    for rid, lora in [("none", None), ("other", "b"), ("same", "a")]:
        before = sched.stats.prefix_cache_hits
        _add(sched, rid, prompt, lora, max_tokens=1)
        run(sched, runner)
        hits.append(sched.stats.prefix_cache_hits - before)
    assert hits == [0, 0, 12]
