"""How much of a step's host work the engine loop hides under the device step.

    python bench/overlap.py [--steps 40] [--device-ms 20,10] [--host-ms 10,20]
    python bench/overlap.py --host-work [--seqs 256] [--contexts 2048,16384] [--steps 40]

With a simulated device (``jaxpaged.engine.testing.TimedDeviceRunner``: every step takes
``device`` ms on the "device" and ``host`` ms of host work), it times the real EngineCore
(overlapped: step N+1 planned and dispatched while step N runs) against the same scheduler
stepped in turn (plan, run, wait, update), and prints ms per step for each pair: overlapped
should be max(device, host), in turn device + host.

``--host-work``: what the host's share of a step is, on an instant device. ``seqs`` requests
of each context length decode together; it times the real EngineCore's steps (scheduler,
output processing, and the runner's host work: its persistent batch's update and the padded
step inputs, :mod:`jaxpaged.worker.input_batch`) and prints host ms per decode step. On an
accelerator whose step takes a few ms this is what bounds the step. The script also runs on
commits before the persistent batch (there the runner rebuilt every step's inputs with
``Runner.build_batch``), so the two can be measured side by side.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine.core import EngineCore, EngineRequest
from jaxpaged.engine.testing import TimedDeviceRunner, run_serial
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import RunnerOutput, SchedulerOutput
from jaxpaged.sched.request import Request
from jaxpaged.sched.scheduler import Scheduler
from jaxpaged.worker.buckets import BucketSet

BLOCK_SIZE = 16
VOCAB = 32000


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


def runner_host_work(
    config: SchedulerConfig,
) -> Callable[[SchedulerOutput], object]:
    """The real runner's host work per step, without a device: the persistent batch's update
    and the step's padded inputs (or, on commits before it, ``Runner.build_batch``)."""
    buckets = BucketSet(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        block_size=BLOCK_SIZE,
    )
    key = np.zeros(2, np.uint32)
    try:
        from jaxpaged.worker.input_batch import InputBatch
    except ImportError:  # before the persistent batch: every step rebuilt from the plan
        from jaxpaged.worker.runner import Runner

        stand_in = SimpleNamespace(  # what build_batch reads of a Runner
            layout=SimpleNamespace(block_size=BLOCK_SIZE),
            lora=None,
            model_config=SimpleNamespace(vocab_size=VOCAB),
            engine_key_data=key,
            processor_names=(),
        )

        def rebuild(plan: SchedulerOutput) -> object:
            return plan.seqs and Runner.build_batch(stand_in, plan.seqs, buckets.pick(plan.seqs))

        return rebuild
    batch = InputBatch(
        max_rows=config.max_num_seqs,
        max_blocks=buckets.full_blocks,
        block_size=BLOCK_SIZE,
        vocab_size=VOCAB,
        engine_key_data=key,
    )

    def persistent(plan: SchedulerOutput) -> object:
        batch.update(plan)
        return plan.seqs and batch.prepare(plan.seqs, buckets.pick(plan.seqs))

    return persistent


class InstantDevice(TimedDeviceRunner):
    """TimedDeviceRunner's token rule on a device that takes no time, after the runner's host
    work; each request's prompt sum is taken once (the stand-in's own work must not grow
    with the context)."""

    def __init__(self, scheduler: Scheduler, host_work: Callable[[SchedulerOutput], object]):
        super().__init__(scheduler, device_seconds=0.0, host_seconds=0.0)
        self.work = host_work
        self.sums: dict[str, int] = {}

    def dispatch(self, plan: SchedulerOutput) -> tuple[float, RunnerOutput] | None:
        self.work(plan)
        if not plan.seqs:
            return None
        tokens = []
        for s in plan.seqs:
            if not s.do_sample:
                tokens.append(-1)
                continue
            rid = s.request_id
            if rid not in self.sums:
                self.sums[rid] = sum(self.scheduler.requests[rid].prompt_token_ids)
            counter = getattr(s, "key_counter", None)
            counter = s.sampling.key_counter if counter is None else counter  # older plans
            tokens.append((self.sums[rid] + counter) % self.vocab)
        self.num_steps += 1
        return 0.0, RunnerOutput(sampled_token_ids=tokens)


def host_ms_per_step(num_seqs: int, context: int, max_context: int, steps: int) -> float:
    """Host ms per decode step of the EngineCore with ``num_seqs`` requests of ``context``
    prompt tokens decoding (``max_context`` sizes the engine, so every context runs the same
    shapes)."""
    # none may finish before the last one has prefilled (one or two steps each)
    max_tokens = 2 * num_seqs + steps + 8
    max_len = max_context + max_tokens
    config = SchedulerConfig(
        max_num_seqs=num_seqs, max_num_batched_tokens=16384, max_model_len=max_len
    )
    num_blocks = num_seqs * -(-max_len // BLOCK_SIZE)
    scheduler = Scheduler(config, CacheConfig(block_size=BLOCK_SIZE), num_blocks=num_blocks)
    device = InstantDevice(scheduler, runner_host_work(config))
    core = EngineCore(
        scheduler=scheduler,
        runner=device,
        tokenizer=None,
        eos_token_ids=(),
        num_kv_blocks=num_blocks,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        core.add_request(
            EngineRequest(
                request_id=f"r{i}",
                prompt=None,
                prompt_token_ids=(i % 200 + 1,) + (7,) * (context - 1),  # no shared prefix
                params=params,
                arrival_time=time.time(),
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        )
    requests = scheduler.requests
    core.step()
    if len(requests) != num_seqs:
        raise RuntimeError("the scheduler refused requests (see the log)")
    while any(not r.output_token_ids for r in requests.values()):
        core.step()  # prefills: not timed
    for _ in range(3):
        core.step()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    return (time.perf_counter() - start) * 1e3 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device-ms", default="20,10")
    p.add_argument("--host-ms", default="10,20")
    p.add_argument("--host-work", action="store_true", help="host ms per step at --seqs")
    p.add_argument("--seqs", type=int, default=256, help="decoding requests (--host-work)")
    p.add_argument("--contexts", default="2048,16384", help="prompt tokens (--host-work)")
    args = p.parse_args()
    if args.host_work:
        contexts = [int(x) for x in args.contexts.split(",")]
        print(f"{args.seqs} sequences decoding, instant device: host ms per step")
        print("context tokens  host ms/step")
        for context in contexts:
            ms = host_ms_per_step(args.seqs, context, max(contexts), args.steps)
            print(f"{context:14d}  {ms:12.2f}")
        return
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
