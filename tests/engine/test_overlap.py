"""The engine loop overlaps host and device: with a fake device whose steps take X seconds
and host work of Y seconds per step, the loop takes about max(X, Y) per step, where running
them in turn takes X + Y. The real EngineCore, scheduler and output processing run; only the
device is simulated (jaxpaged.engine.testing.TimedDeviceRunner)."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine.core import EngineCore, EngineRequest
from jaxpaged.engine.testing import TimedDeviceRunner, expected_tokens, run_serial
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.request import Request
from jaxpaged.sched.scheduler import Scheduler
from jaxpaged.worker.buckets import BucketSet
from jaxpaged.worker.input_batch import InputBatch

STEPS = 16


def make_scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=16),
        num_blocks=64,
    )


def overlapped_seconds_per_step(device: float, host: float) -> tuple[float, list[int]]:
    scheduler = make_scheduler()
    runner = TimedDeviceRunner(scheduler, device_seconds=device, host_seconds=host)
    core = EngineCore(
        scheduler=scheduler, runner=runner, tokenizer=None, eos_token_ids=(), num_kv_blocks=64
    )
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    core.add_request(
        EngineRequest(
            request_id="r",
            prompt=None,
            prompt_token_ids=(5, 6, 7),
            params=params,
            arrival_time=0.0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    )
    core.step()  # the prefill: not timed
    start, final = time.perf_counter(), None
    while core.has_work():
        for out in core.step():
            final = out
    elapsed = time.perf_counter() - start
    assert final is not None and final.finished
    return elapsed / (runner.num_steps - 1), list(final.outputs[0].token_ids)


def serial_seconds_per_step(device: float, host: float) -> float:
    scheduler = make_scheduler()
    runner = TimedDeviceRunner(scheduler, device_seconds=device, host_seconds=host)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    scheduler.add_request(
        Request(request_id="r", prompt_token_ids=[5, 6, 7], sampling_params=params)
    )
    start = time.perf_counter()
    steps = run_serial(scheduler, runner)
    return (time.perf_counter() - start) / steps


@pytest.mark.parametrize(("device", "host"), [(0.06, 0.03), (0.03, 0.06)])
def test_loop_time_per_step_is_the_longer_of_device_and_host(device, host):
    per_step, tokens = overlapped_seconds_per_step(device, host)
    assert tokens == expected_tokens([5, 6, 7], STEPS, 1000)  # the overlap changes no token
    serial = serial_seconds_per_step(device, host)
    assert serial >= 0.95 * (device + host)  # in turn, the two add up
    # overlapped: close to the longer one, far from the sum (sleeps overshoot a little on a
    # busy machine, so the bound is the midpoint)
    longer, shorter = max(device, host), min(device, host)
    assert longer * 0.95 <= per_step < longer + 0.5 * shorter, (per_step, serial)
    assert serial - per_step > 0.5 * shorter, (per_step, serial)


def decode_host_work(context: int, num_seqs: int = 16, steps: int = 16) -> list[tuple[int, ...]]:
    """Per decode step of the real EngineCore on the fake device, with the runner's host work
    (its persistent batch's update and step inputs): (ints the plan carries for the batch:
    token ids, block ids, new requests; block-table entries written into the persistent
    arrays; elements of the step's host arrays). ``num_seqs`` requests of ``context`` prompt
    tokens, on an engine sized for the longest context tested."""
    max_tokens = steps + 64  # none finishes in the timed steps (leaving clears a row)
    block_size, max_len = 16, 1024 + max_tokens
    config = SchedulerConfig(
        max_num_seqs=num_seqs, max_num_batched_tokens=2048, max_model_len=max_len
    )
    num_blocks = num_seqs * -(-max_len // block_size)
    scheduler = Scheduler(config, CacheConfig(block_size=block_size), num_blocks=num_blocks)
    buckets = BucketSet(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_len,
        block_size=block_size,
    )
    batch = InputBatch(
        max_rows=num_seqs,
        max_blocks=buckets.full_blocks,
        block_size=block_size,
        vocab_size=1000,
        engine_key_data=np.zeros(2, np.uint32),
    )
    record: list[tuple[int, ...]] = []

    def host_work(plan):
        written = batch.entries_written
        batch.update(plan)
        elements = 0
        if plan.seqs:
            step, _ = batch.prepare(plan.seqs, buckets.pick(plan.seqs))
            elements = sum(np.asarray(a).size for a in jax.tree.leaves(step))
        carried = len(plan.new_requests) + sum(
            len(s.token_ids) + len(s.new_block_ids) for s in plan.seqs
        )
        record.append((carried, batch.entries_written - written, elements))

    runner = TimedDeviceRunner(scheduler, device_seconds=0.0, host_seconds=0.0, host_work=host_work)
    core = EngineCore(
        scheduler=scheduler,
        runner=runner,
        tokenizer=None,
        eos_token_ids=(),
        num_kv_blocks=num_blocks,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        core.add_request(
            EngineRequest(
                request_id=f"r{i}",
                prompt=None,
                prompt_token_ids=(i + 1,) + (3,) * (context - 1),
                params=params,
                arrival_time=0.0,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        )
    requests = scheduler.requests
    core.step()
    assert len(requests) == num_seqs  # every request admitted
    while any(not r.output_token_ids for r in requests.values()):
        core.step()  # the prefills
    assert len(requests) == num_seqs  # none finished
    record.clear()
    for _ in range(steps):
        core.step()
    return record


def test_host_work_per_decode_step_does_not_grow_with_context():
    """The plan carries one token per decode and only the block ids that changed, and the
    persistent batch writes only those: 64 or 1024 tokens of context, a decode step's host
    work is the same. (Rebuilding the batch every step sent and copied every request's whole
    block table: 4 against 64 entries per request per step here.)"""
    short, long = decode_host_work(64), decode_host_work(1024)
    for record in (short, long):
        assert len(record) == 16
        for carried, written, _ in record:
            # one token each, at most one new block each (16 decodes, block size 16)
            assert carried <= 2 * 16 and written <= 16
    # 16 decode steps cross one block boundary per request whatever the context
    assert sum(r[1] for r in short) == sum(r[1] for r in long) == 16
    assert sum(r[0] for r in short) == sum(r[0] for r in long) == 16 * 16 + 16
    assert [r[2] for r in short] == [r[2] for r in long]  # the same step shapes
