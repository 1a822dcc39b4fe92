"""Fake devices for testing engine code without a model: the admin side every fake runner
shares (:class:`FakeDeviceAdmin`), and a device with a fixed step time, for measuring the
engine loop's overlap (``tests/engine/test_overlap.py`` and ``bench/overlap.py``).

:class:`TimedDeviceRunner` behaves like the real runner seen from the host: ``dispatch``
returns at once after ``host_seconds`` of host work (building the batch; or the runner's own
host work, ``host_work``: e.g. its persistent batch's update and step inputs), the device runs
the steps one after another, each ``device_seconds`` long, starting when it is dispatched or
when the previous one ends, and ``collect`` waits for the step's end. Its tokens are a fixed
rule (``(prompt sum + position) % vocab``), so outputs are checkable by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jaxpaged.sched.output import RunnerOutput, SchedulerOutput
from jaxpaged.sched.scheduler import Scheduler

__all__ = [
    "FakeDeviceAdmin",
    "TimedDeviceRunner",
    "expected_tokens",
    "run_serial",
]


def expected_tokens(prompt: list[int], num_tokens: int, vocab: int) -> list[int]:
    """What :class:`TimedDeviceRunner` samples for a request: the rule on its positions."""
    s = sum(prompt)
    return [(s + i) % vocab for i in range(num_tokens)]


class FakeDeviceAdmin:
    """The admin side of a fake runner (``DeviceRunner``'s members besides the step): warm-up
    compiles nothing, the weights are whatever was given last (``params``), and the KV pool is
    a flag: ``release_kv`` frees it (reporting ``kv_bytes``), ``restore_kv`` makes it fresh
    again, and a step on a released pool fails (:meth:`check_kv`)."""

    params: object = None  # any pytree
    kv_bytes: int = 0
    _kv_released: bool = False

    def warm_up(self, *, swap: bool = False, show_progress: bool = True) -> tuple[int, float]:
        return 0, 0.0

    def update_params(self, params: object) -> None:
        self.params = params

    def release_params(self) -> None:
        self.params = None

    def release_kv(self) -> int:
        self._kv_released = True
        return self.kv_bytes

    def restore_kv(self) -> None:
        self._kv_released = False

    @property
    def kv_released(self) -> bool:
        return self._kv_released

    def check_kv(self) -> None:
        """RuntimeError if the KV pool is released: the engine must not step while asleep."""
        if self._kv_released:
            raise RuntimeError("a step was dispatched on a released KV pool (sleep)")


class TimedDeviceRunner(FakeDeviceAdmin):
    """Dispatch/collect with a simulated device (see the module docstring)."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        device_seconds: float,
        host_seconds: float,
        vocab: int = 1000,
        clock: Callable[[], float] = time.perf_counter,
        host_work: Callable[[SchedulerOutput], Any] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.host_work = host_work
        self.device_seconds = device_seconds
        self.host_seconds = host_seconds
        self.vocab = vocab
        self.clock = clock
        self._device_free_at = 0.0
        self.num_steps = 0
        self._prompt_sums: dict[str, int] = {}  # per request in the batch: its token rule's base

    def dispatch(
        self, plan: SchedulerOutput, allowed: object = None
    ) -> tuple[float, RunnerOutput] | None:
        self.check_kv()  # ``allowed`` (structured-output masks) does not change the rule
        if self.host_seconds and plan.seqs:
            time.sleep(self.host_seconds)  # the host's share of a step (building its batch)
        if self.host_work is not None:
            self.host_work(plan)
        sums = self._prompt_sums
        for rid in (*plan.finished_request_ids, *plan.preempted_request_ids):
            sums.pop(rid, None)
        for data in plan.new_requests:  # summed once per request, not per step
            sums[data.request_id] = sum(self.scheduler.requests[data.request_id].prompt_token_ids)
        if not plan.seqs:
            return None
        tokens = []
        for s in plan.seqs:
            if not s.do_sample:
                tokens.append(-1)
                continue
            tokens.append((sums[s.request_id] + s.key_counter) % self.vocab)
        start = max(self.clock(), self._device_free_at)
        self._device_free_at = start + self.device_seconds
        self.num_steps += 1
        return self._device_free_at, RunnerOutput(sampled_token_ids=tokens)

    def collect(self, pending: tuple[float, RunnerOutput] | None) -> RunnerOutput:
        if pending is None:
            return RunnerOutput(sampled_token_ids=())
        done_at, out = pending
        wait = done_at - self.clock()
        if wait > 0:
            time.sleep(wait)
        return out

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.dispatch(plan))


def run_serial(scheduler: Scheduler, runner: TimedDeviceRunner) -> int:
    """The loop without overlap, for comparison: plan, run, wait, update, in turn. Returns
    the steps run."""
    steps = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        scheduler.update(plan, runner.collect(runner.dispatch(plan)))
        steps += 1
    return steps
