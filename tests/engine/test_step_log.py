"""$JAXPAGED_STEP_LOG: the engine writes one line per step with its time and the composition
of the plan it finished, checked against a hand-planned schedule on the simulated device."""

from __future__ import annotations

import dataclasses
import gc
import json
import time

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine.core import EngineCore, EngineRequest
from jaxpaged.engine.step_log import ENV_VAR
from jaxpaged.engine.testing import TimedDeviceRunner
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.scheduler import Scheduler


def _request(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt=None,
        prompt_token_ids=tuple(prompt),
        params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        arrival_time=0.0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def test_each_step_logs_its_time_and_the_plan_it_finished(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=256,
            max_prefill_tokens_with_decodes=8,
        ),  # fmt: skip
        CacheConfig(block_size=16),
        num_blocks=64,
    )
    runner = TimedDeviceRunner(scheduler, device_seconds=0.01, host_seconds=0.0)
    core = EngineCore(
        scheduler=scheduler, runner=runner, tokenizer=None, eos_token_ids=(), num_kv_blocks=64
    )
    gc.disable()  # collections only where the test runs one
    try:
        core.add_request(_request("a", [5, 6, 7], max_tokens=4))
        core.step()  # a's prompt
        b = _request("b", list(range(1, 21)), max_tokens=2)  # 20 tokens, cap 8
        core.add_request(dataclasses.replace(b, arrival_time=time.time()))
        t0 = time.perf_counter()
        gc.collect()  # counted in the next step's line
        while core.has_work():
            core.step()
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    core.step_log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    shapes = [(s.get("decodes"), s.get("prefill")) for s in lines]
    # step k's line carries plan k-1: a's prompt; a's decodes beside b's chunks 8, 8, 4; ...
    assert shapes[:5] == [(None, None), (0, 3), (1, 8), (1, 8), (1, 4)]
    # b's one decode (a's last token was in flight), collected by a step that plans nothing
    assert shapes[5:] == [(1, 0)] and all(s["ms"] > 0 for s in lines)
    assert sum(s["ms"] for s in lines[1:]) <= elapsed * 1e3
    assert lines[1]["gc_ms"] > 0 and lines[0]["gc_ms"] == 0
    # per request: the step dispatching its first chunk, the one collecting its first token
    assert [sorted(s.get("waits", {})) for s in lines] == [["a"], ["b"], [], [], [], []]
    assert lines[1]["waits"]["b"] >= 0  # b arrived (time.time) before the step began
    assert [s.get("first_tokens", []) for s in lines] == [[], ["a"], [], [], ["b"], []]


def test_no_log_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=16), num_blocks=8)
    core = EngineCore(
        scheduler=scheduler,
        runner=TimedDeviceRunner(scheduler, device_seconds=0.0, host_seconds=0.0),
        tokenizer=None,
        eos_token_ids=(),
        num_kv_blocks=8,
    )
    assert core.step_log is None
