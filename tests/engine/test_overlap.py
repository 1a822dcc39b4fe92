"""The engine loop overlaps host and device: with a fake device whose steps take X seconds
and host work of Y seconds per step, the loop takes about max(X, Y) per step, where running
them in turn takes X + Y. The real EngineCore, scheduler and output processing run; only the
device is simulated (jaxpaged.engine.testing.TimedDeviceRunner)."""

from __future__ import annotations

import time

import pytest

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine.core import EngineCore, EngineRequest
from jaxpaged.engine.testing import TimedDeviceRunner, expected_tokens, run_serial
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.request import Request
from jaxpaged.sched.scheduler import Scheduler

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
