"""Aids for testing engine code without a model: a structural check that a class implements
one of the engine's protocols (``EngineClient``, ``DeviceRunner``) member by member, and a
fake device with a fixed step time, for measuring the engine loop's overlap
(``tests/engine/test_overlap.py`` and ``bench/overlap.py``).

:class:`TimedDeviceRunner` behaves like the real runner seen from the host: ``dispatch``
returns at once after ``host_seconds`` of host work (building the batch), the device runs
the steps one after another, each ``device_seconds`` long, starting when it is dispatched or
when the previous one ends, and ``collect`` waits for the step's end. Its tokens are a fixed
rule (``(prompt sum + position) % vocab``), so outputs are checkable by hand.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxpaged.sched.output import RunnerOutput, SchedulerOutput
from jaxpaged.sched.scheduler import Scheduler

__all__ = [
    "FakeDeviceAdmin",
    "TimedDeviceRunner",
    "assert_implements",
    "expected_tokens",
    "protocol_members",
    "protocol_problems",
    "run_serial",
]


def protocol_members(protocol: type) -> dict[str, object]:
    """A protocol's members as it declares them: name -> property or function."""
    return {name: v for name, v in vars(protocol).items() if not name.startswith("_")}


def _property_problems(obj: object, cls: type, name: str) -> list[str]:
    got = inspect.getattr_static(cls, name, None)
    if isinstance(got, property):
        return []
    if not isinstance(obj, type) and name in getattr(obj, "__dict__", {}):
        return []  # a plain instance attribute also satisfies a protocol property
    return [f"{name}: must be a property (or, checking an instance, an attribute)"]


def _parameter_problems(name: str, want: inspect.Signature, got: inspect.Signature) -> list[str]:
    """Every protocol parameter exists with the same name, kind, position (if positional)
    and default; any extra parameter of the implementation is optional."""
    problems = []
    want_params = [p for p in want.parameters.values() if p.name != "self"]
    got_params = {p.name: p for p in got.parameters.values() if p.name != "self"}
    got_order = [p.name for p in got.parameters.values() if p.name != "self"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(want_params):
        q = got_params.get(p.name)
        if q is None:
            problems.append(f"{name}: no parameter {p.name!r}")
            continue
        if q.kind != p.kind:
            problems.append(f"{name}: parameter {p.name!r} is {q.kind.description}, "
                            f"the protocol's is {p.kind.description}")  # fmt: skip
        elif p.kind in positional and got_order.index(p.name) != i:
            problems.append(f"{name}: parameter {p.name!r} is not at position {i}")
        if p.default is not inspect.Parameter.empty and q.default != p.default:
            problems.append(f"{name}: parameter {p.name!r} defaults to {q.default!r}, "
                            f"the protocol's to {p.default!r}")  # fmt: skip
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for q in got_params.values():
        extra = q.name not in {p.name for p in want_params}
        if extra and q.kind not in variadic and q.default is inspect.Parameter.empty:
            problems.append(f"{name}: extra parameter {q.name!r} has no default")
    return problems


def _method_problems(cls: type, name: str, want: object) -> list[str]:
    got = inspect.getattr_static(cls, name, None)
    if got is None:
        return [f"{name}: missing"]
    if isinstance(got, (staticmethod, classmethod)) or not inspect.isfunction(got):
        return [f"{name}: must be a plain method, got {type(got).__name__}"]
    if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
        how = "async def" if inspect.iscoroutinefunction(want) else "def (not async)"
        return [f"{name}: must be {how}"]
    return _parameter_problems(name, inspect.signature(want), inspect.signature(got))


def protocol_problems(protocol: type, obj_or_cls: object) -> list[str]:
    """What keeps ``obj_or_cls`` (a class, or an instance when some protocol properties are
    plain instance attributes) from implementing ``protocol``: each member must exist,
    properties as properties, methods async exactly where the protocol's are, with the
    protocol's parameter names, kinds, positions and defaults (extra parameters optional).
    ``isinstance`` on a runtime-checkable protocol checks only that the names exist."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    problems = []
    for name, want in protocol_members(protocol).items():
        if isinstance(want, property):
            problems += _property_problems(obj_or_cls, cls, name)
        else:
            problems += _method_problems(cls, name, want)
    return problems


def assert_implements(protocol: type, obj_or_cls: object) -> None:
    """Fails, naming every problem (:func:`protocol_problems`), unless ``obj_or_cls``
    implements ``protocol``."""
    problems = protocol_problems(protocol, obj_or_cls)
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    assert not problems, (
        f"{cls.__name__} does not implement {protocol.__name__}:\n  " + "\n  ".join(problems)
    )


def expected_tokens(prompt: list[int], num_tokens: int, vocab: int) -> list[int]:
    """What :class:`TimedDeviceRunner` samples for a request: the rule on its positions."""
    s = sum(prompt)
    return [(s + i) % vocab for i in range(num_tokens)]


class FakeDeviceAdmin:
    """The admin side of a fake runner (``DeviceRunner``'s members besides the step): warm-up
    compiles nothing, the weights are whatever was given last (``params``), and the KV pool is
    a flag: ``release_kv`` frees it (reporting ``kv_bytes``), ``restore_kv`` makes it fresh
    again, and a step on a released pool fails (:meth:`check_kv`)."""

    params: Any = None
    kv_bytes: int = 0
    _kv_released: bool = False

    def warm_up(self, *, swap: bool = False, show_progress: bool = True) -> tuple[int, float]:
        return 0, 0.0

    def update_params(self, params: Any) -> None:  # noqa: ANN401 - any pytree
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
    ) -> None:
        self.scheduler = scheduler
        self.device_seconds = device_seconds
        self.host_seconds = host_seconds
        self.vocab = vocab
        self.clock = clock
        self._device_free_at = 0.0
        self.num_steps = 0

    def dispatch(
        self, plan: SchedulerOutput, allowed: Mapping[int, np.ndarray] | None = None
    ) -> tuple[float, RunnerOutput] | None:
        self.check_kv()
        time.sleep(self.host_seconds)  # the host's share of a step
        if not plan.seqs:
            return None
        tokens = []
        for s in plan.seqs:
            if s.sampling is None:
                tokens.append(-1)
                continue
            prompt = self.scheduler.requests[s.request_id].prompt_token_ids
            tokens.append((sum(prompt) + s.sampling.key_counter) % self.vocab)
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
