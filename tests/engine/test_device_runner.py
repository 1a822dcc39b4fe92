"""``DeviceRunner`` says everything the engine calls on a runner: the real Runner and every
fake implement it member by member (names, async-ness, parameters and defaults), so a fake
cannot lack what the engine relies on, and the core's sleep / wake / weight calls use
nothing else (checked on the timed fake, whose tokens are computable by hand)."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner
from test_core import FailingRunner, drive, make_core, text_of

from jaxpaged.engine.core import DeviceRunner
from jaxpaged.engine.protocol_check import assert_implements, protocol_members
from jaxpaged.engine.testing import TimedDeviceRunner
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.runner import Runner


def test_the_protocol_has_the_members_the_engine_calls():
    assert set(protocol_members(DeviceRunner)) == {
        "dispatch", "collect", "execute", "warm_up",
        "update_params", "release_params", "release_kv", "restore_kv", "kv_released",
    }  # fmt: skip


@pytest.mark.parametrize("cls", [Runner, FakeRunner, TimedDeviceRunner, FailingRunner])
def test_runners_implement_device_runner(cls):
    assert_implements(DeviceRunner, cls)


def test_instances_are_device_runners():
    core, _, runner = make_core()
    assert isinstance(runner, DeviceRunner)
    assert isinstance(FakeRunner(8, 4, scheduler=core.scheduler), DeviceRunner)


class _NoMask(TimedDeviceRunner):
    def dispatch(self, plan):
        return super().dispatch(plan)


class _AsyncCollect(TimedDeviceRunner):
    async def collect(self, pending):
        raise NotImplementedError


class _NoRestore(TimedDeviceRunner):
    restore_kv = None


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (_NoMask, "dispatch: no parameter 'allowed'"),
        (_AsyncCollect, r"collect: must be def \(not async\)"),
        (_NoRestore, "restore_kv: missing"),
    ],
)
def test_the_check_catches_drift(cls, message):
    with pytest.raises(AssertionError, match=message):
        assert_implements(DeviceRunner, cls)


def test_sleep_wake_and_new_weights_go_through_the_protocol():
    core, inputs, runner = make_core()
    runner.kv_bytes = 1234
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    core.add_request(inputs.process("a", "ab", params, output_kind=RequestOutputKind.FINAL_ONLY))
    core.step_inbox()  # admitted
    with pytest.raises(RuntimeError, match="unfinished"):
        core.sleep(1)
    (out,) = drive(core)
    assert out.outputs[0].text == text_of("ab", 5)
    assert core.sleep(2) == 1234 and runner.kv_released and runner.params is None
    assert core.sleep(1) == 0  # already freed
    with pytest.raises(RuntimeError, match="weights were dropped"):
        core.wake_up()
    weights = {"w": 1}
    core.update_weights(weights)
    assert runner.params is weights and runner.kv_released
    core.wake_up()
    assert not runner.kv_released and core.sleep_level == 0
    core.add_request(inputs.process("b", "cd", params, output_kind=RequestOutputKind.FINAL_ONLY))
    (out,) = drive(core)
    assert out.outputs[0].text == text_of("cd", 5)


def test_a_fake_refuses_a_step_on_a_released_pool():
    core, _, runner = make_core()
    runner.release_kv()
    with pytest.raises(RuntimeError, match="released KV pool"):
        runner.dispatch(core.scheduler.schedule())
