"""How much of a step's host work the engine loop hides under the device step.

    python bench/overlap.py [--steps 40] [--device-ms 20,10] [--host-ms 10,20]

With a simulated device (``jaxpaged.engine.testing.TimedDeviceRunner``: every step takes
``device`` ms on the "device" and ``host`` ms of host work), it times the real EngineCore
(overlapped: step N+1 planned and dispatched while step N runs) against the same scheduler
stepped in turn (plan, run, wait, update), and prints ms per step for each pair: overlapped
should be max(device, host), in turn device + host.
"""

from __future__ import annotations

import argparse
import time

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine.core import EngineCore, EngineRequest
from jaxpaged.engine.testing import TimedDeviceRunner, run_serial
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.request import Request
from jaxpaged.sched.scheduler import Scheduler


def _scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096),
        CacheConfig(block_size=16),
        num_blocks=512,
    )


def overlapped_ms(device_ms: float, host_ms: float, steps: int) -> float:
    scheduler = _scheduler()
    runner = TimedDeviceRunner(
        scheduler, device_seconds=device_ms / 1e3, host_seconds=host_ms / 1e3
    )
    core = EngineCore(
        scheduler=scheduler, runner=runner, tokenizer=None, eos_token_ids=(), num_kv_blocks=512
    )
    core.add_request(
        EngineRequest(
            request_id="r",
            prompt=None,
            prompt_token_ids=(1, 2, 3),
            params=SamplingParams(max_tokens=steps, ignore_eos=True),
            arrival_time=time.time(),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    )
    core.step()  # prefill: not timed
    start = time.perf_counter()
    while core.has_work():
        core.step()
    return (time.perf_counter() - start) * 1e3 / (runner.num_steps - 1)


def serial_ms(device_ms: float, host_ms: float, steps: int) -> float:
    scheduler = _scheduler()
    runner = TimedDeviceRunner(
        scheduler, device_seconds=device_ms / 1e3, host_seconds=host_ms / 1e3
    )
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    scheduler.add_request(
        Request(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=params)
    )
    start = time.perf_counter()
    n = run_serial(scheduler, runner)
    return (time.perf_counter() - start) * 1e3 / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device-ms", default="20,10")
    p.add_argument("--host-ms", default="10,20")
    args = p.parse_args()
    pairs = zip(
        (float(x) for x in args.device_ms.split(",")),
        (float(x) for x in args.host_ms.split(",")),
        strict=True,
    )
    print("device ms  host ms  overlapped ms/step  in turn ms/step  max(X,Y)  X+Y")
    for device, host in pairs:
        o = overlapped_ms(device, host, args.steps)
        s = serial_ms(device, host, args.steps)
        print(f"{device:9.1f}  {host:7.1f}  {o:18.2f}  {s:15.2f}  {max(device, host):8.1f}  "
              f"{device + host:4.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
