"""The prefill caps measured at warm-up (jaxpaged.engine.prefill_budget): the line through a
decode step's time and a mixed step's, against hand-computed caps; the caps by decode count,
interpolated between measured counts; the plans it times, on a fake clock whose step cost is
a + b x rows, where every count's cap keeps its step within the stall ratio; and a real
engine, which sets the caps it measured and compiles nothing for them."""

from __future__ import annotations

import argparse
import types

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.args import DEFAULT_PREFILL_STALL_RATIO, EngineArgs
from jaxpaged.config import SchedulerConfig
from jaxpaged.engine import LLMEngine
from jaxpaged.engine.prefill_budget import (
    CONTEXT_TOKENS,
    MIN_PREFILL_CAP,
    UNMEASURED_PREFILL_CAP,
    StepCosts,
    calibration_plans,
    caps_by_decodes,
    choose_prefill_cap,
    measure_step_costs,
)
from jaxpaged.engine.warm_start import warm_start
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import RunnerOutput


def costs(decode_ms, mixed_ms, chunk=64):
    return StepCosts(
        decodes=15, context=256, chunk=chunk, decode_s=decode_ms / 1e3, mixed_s=mixed_ms / 1e3
    )


def test_cap_is_where_the_line_reaches_the_stall_ratio():
    # 88 ms alone, + 64 tokens 344 ms: 4 ms a token; 3x allows 176 ms more: 44 tokens
    assert costs(88, 344).prefill_cap(3.0, 512) == 44
    assert costs(88, 344).prefill_cap(3.5, 512) == 55  # 220 ms / 4 ms
    assert costs(100, 132, chunk=32).prefill_cap(2.0, 2048) == 100  # 1 ms a token
    # a step flat in its rows (an accelerator below its compute knee): the whole budget
    assert costs(10, 10).prefill_cap(3.0, 512) == 512
    assert costs(10, 9.5).prefill_cap(3.0, 512) == 512  # timing noise below the decode step
    assert costs(10, 10.5).prefill_cap(3.0, 512) == 512  # 2560 tokens allowed, 512 budget
    # a very slow prompt token: never below one block's worth, nor above the budget
    assert costs(10, 1000).prefill_cap(3.0, 512) == MIN_PREFILL_CAP
    assert costs(10, 1000).prefill_cap(3.0, 8) == 8


class FakeDevice:
    """A step costs A + B x its rows on a fake clock; the first call of each plan 10x that
    (first touches), which the measurement must not count."""

    A, B = 0.020, 0.004

    def __init__(self):
        self.now = 0.0
        self.plans = []

    def clock(self):
        return self.now

    def execute(self, plan):
        rows = sum(s.num_tokens for s in plan.seqs)
        first = all(p is not plan for p in self.plans)
        self.now += (self.A + self.B * rows) * (10 if first else 1)
        self.plans.append(plan)
        return RunnerOutput(sampled_token_ids=[0] * len(plan.seqs))


def test_caps_by_decodes_interpolate_between_the_measured_counts():
    rungs = (
        StepCosts(decodes=1, context=256, chunk=64, decode_s=0.020, mixed_s=0.148),  # 2 ms/token
        StepCosts(decodes=5, context=256, chunk=64, decode_s=0.060, mixed_s=0.316),  # 4 ms/token
    )
    caps = caps_by_decodes(rungs, 3.0, 512, 8)
    assert len(caps) == 9 and caps[0] == 512  # no decode: nothing stalls
    assert caps[1] == 20  # 2 x 20 ms / 2 ms
    # 3 decodes: halfway, 40 ms and 3 ms a token: 2 x 40 / 3 = 26.7
    assert caps[3] == 26
    assert caps[5] == caps[6] == caps[8] == 30  # 2 x 60 / 4, held past the last count
    one = caps_by_decodes(rungs[:1], 3.0, 512, 3)
    assert one == (512, 20, 20, 20)
    with pytest.raises(ValueError, match="at least one"):
        caps_by_decodes((), 3.0, 512, 3)


def test_measured_costs_and_plans_on_a_fake_clock():
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024)
    device = FakeDevice()
    got = measure_step_costs(
        device.execute, config, num_blocks=400, block_size=16, clock=device.clock
    )
    assert [r.decodes for r in got] == [1, 3, 15]  # 1, 15 // 4 and the most
    for r in got:
        assert (r.context, r.chunk) == (CONTEXT_TOKENS, 64)
        assert r.decode_s == pytest.approx(0.020 + 0.004 * r.decodes)
        assert r.mixed_s == pytest.approx(0.020 + 0.004 * (r.decodes + 64))
        assert r.chunk_token_s == pytest.approx(0.004)
    # 3x a 80 ms decode step allows 160 ms more: 40 tokens
    assert got[-1].prefill_cap(3.0, 512) == 40
    # at every decode count above the floor the cap's step is within 3 decode steps, and
    # one token more is not
    caps = caps_by_decodes(got, 3.0, 512, 16)
    assert caps[1] == caps[2] == MIN_PREFILL_CAP  # 2 x 24 ms / 4 ms: 12 tokens, floored
    assert caps[3] == 16 and caps[15] == caps[16] == 40  # held past 15 decodes
    for d in range(3, 16):
        alone = FakeDevice.A + FakeDevice.B * d
        assert FakeDevice.A + FakeDevice.B * (d + caps[d]) <= 3.0 * alone + 1e-9
        assert FakeDevice.A + FakeDevice.B * (d + caps[d] + 1) > 3.0 * alone
    # each count: one untimed and three timed pairs, then the plan dropping its requests
    assert len(device.plans) == 3 * 9
    decode, mixed = device.plans[-9], device.plans[-8]
    assert all(p in (decode, mixed) for p in device.plans[-9:-1])
    cleanup = device.plans[-1]
    assert not cleanup.seqs and set(cleanup.finished_request_ids) == {
        s.request_id for s in mixed.seqs
    }
    assert [s.num_tokens for s in mixed.seqs] == [1] * 15 + [64]
    assert mixed.seqs[:15] == decode.seqs
    assert [d.request_id for d in mixed.new_requests] == [s.request_id for s in mixed.seqs]
    for s in decode.seqs:
        assert s.kv_len == CONTEXT_TOKENS and s.do_sample
        assert s.block_start == 0 and len(s.new_block_ids) == CONTEXT_TOKENS // 16
    assert mixed.seqs[-1].start_pos == 0 and not mixed.seqs[-1].do_sample
    blocks = [b for s in mixed.seqs for b in s.new_block_ids]
    assert len(set(blocks)) == len(blocks) and max(blocks) < 400  # disjoint, in the pool


def test_sizes_follow_the_config_and_the_pool():
    device = FakeDevice()
    small = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    (*_, got) = measure_step_costs(
        device.execute, small, num_blocks=64, block_size=4, clock=device.clock
    )
    assert (got.decodes, got.context, got.chunk) == (3, 63, 13)
    # 20 blocks: 4 for the chunk (13 tokens), 16 left for 3 decodes: 5 blocks each
    got = measure_step_costs(device.execute, small, num_blocks=20, block_size=4, clock=device.clock)
    assert [r.context for r in got] == [20, 20]  # 1 and 3 decodes
    _, mixed = calibration_plans(decodes=3, context=20, chunk=13, block_size=4)
    assert max(b for s in mixed.seqs for b in s.new_block_ids) == 18  # 15 + 4 blocks
    # a chunk is never longer than a sequence may be (the runner's block tables are that wide)
    short = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=8)
    (got,) = measure_step_costs(
        device.execute, short, num_blocks=64, block_size=4, clock=device.clock
    )
    assert (got.decodes, got.chunk, got.context) == (1, 8, 7)
    # no step carries decodes and a chunk: one sequence at a time, or no room in the pool
    one = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    assert measure_step_costs(device.execute, one, num_blocks=64, block_size=4) is None
    assert measure_step_costs(device.execute, small, num_blocks=5, block_size=4) is None


def test_unmeasured_cap():
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_stall_ratio=3.0)
    never = lambda plan: pytest.fail("nothing may run")  # noqa: E731
    caps, got = choose_prefill_cap(never, config, num_blocks=64, block_size=16, measure=False)
    assert (caps, got) == ((UNMEASURED_PREFILL_CAP,) * (config.max_num_seqs + 1), None)
    small = SchedulerConfig(max_num_batched_tokens=32, prefill_stall_ratio=3.0, max_num_seqs=2)
    caps = choose_prefill_cap(never, small, num_blocks=64, block_size=16, measure=False)[0]
    assert caps == (32, 32, 32)


@pytest.mark.parametrize("bad", [1, 0.5, True, "3", float("nan")])
def test_a_bad_stall_ratio_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="prefill_stall_ratio"):
        SchedulerConfig(prefill_stall_ratio=bad)


def test_engine_args_default_and_flag():
    cfg = tiny_config()
    default = EngineArgs().scheduler_config(cfg)
    assert default.max_prefill_tokens_with_decodes is None
    assert default.prefill_stall_ratio == DEFAULT_PREFILL_STALL_RATIO
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--prefill-stall-ratio", "2.5"]))
    assert args.scheduler_config(cfg).prefill_stall_ratio == 2.5
    for bad in ("1", "0.9", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--prefill-stall-ratio", bad])


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return cfg, jax.tree.map(jnp.asarray, random_params(cfg))


def engine(tiny, **kwargs):
    cfg, params = tiny
    return LLMEngine.from_params(
        cfg, params, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128,
        num_kv_blocks=96, block_size=8, **kwargs,
    )  # fmt: skip


def test_engine_sets_the_caps_it_measured_and_compiles_nothing_for_them(tiny):
    eng = engine(tiny, prefill_stall_ratio=2.0)
    costs = eng.step_costs
    # 96 blocks of 8: 8 for the 64-token chunk, 88 left: 12 blocks (96 tokens) per decode
    assert [(c.decodes, c.chunk, c.context) for c in costs] == [(1, 64, 96), (7, 64, 96)]
    assert all(0 < c.decode_s and 0 < c.mixed_s for c in costs)
    caps = caps_by_decodes(costs, 2.0, 128, 8)
    assert eng.scheduler._caps == caps and all(MIN_PREFILL_CAP <= c <= 128 for c in caps)
    assert caps[1] == costs[0].prefill_cap(2.0, 128) and caps[7] == costs[1].prefill_cap(2.0, 128)
    assert eng.scheduler_config.max_prefill_tokens_with_decodes == max(caps[1:])
    # the timed steps ran warm-up's shapes
    assert eng.get_stats().num_compilations_after_warmup == 0
    assert eng.scheduler.pool.num_free_blocks == 96  # and took no block from the scheduler
    eng.add_request("a", list(range(1, 40)), SamplingParams(temperature=0, max_tokens=4))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.get_stats().num_compilations_after_warmup == 0


def test_a_given_cap_is_kept_and_nothing_is_timed(tiny):
    """warm_start on a fake runner and scheduler: warmed up, then, a cap given, nothing is
    timed (a real engine's warm-up would repeat the test above's); engines built eager (no
    program compiled) keep a given cap, and one left unmeasured gets the default."""
    calls = []

    class Runner:
        def warm_up(self, *, swap, show_progress):
            calls.append("warm_up")
            return 3, 0.5

        def execute(self, plan):
            pytest.fail("a step was timed")

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128,
                             max_prefill_tokens_with_decodes=24, prefill_stall_ratio=2.0)  # fmt: skip
    pool = types.SimpleNamespace(tier=None)
    scheduler = types.SimpleNamespace(config=config, pool=pool, block_size=8,
                                      set_prefill_caps=lambda caps: pytest.fail("caps set"))  # fmt: skip
    ready = warm_start(Runner(), scheduler, num_blocks=96, enforce_eager=False,
                       show_progress=False, mark_compiled=lambda: calls.append("marked"))  # fmt: skip
    assert calls == ["warm_up", "marked"]
    assert (ready.programs, ready.seconds, ready.step_costs) == (3, 0.5, None)
    eng = engine(tiny, max_prefill_tokens_with_decodes=24, enforce_eager=True)
    assert eng.step_costs is None and eng.scheduler.config.max_prefill_tokens_with_decodes == 24
    eager = engine(tiny, enforce_eager=True)
    assert eager.step_costs is None
    assert eager.scheduler.config.max_prefill_tokens_with_decodes == UNMEASURED_PREFILL_CAP
