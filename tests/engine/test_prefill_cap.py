"""The prefill cap of steps that carry decodes (max_prefill_tokens_with_decodes): a new
prompt is prefilled in chunks riding along with the running decodes instead of one step as
long as the budget allows, against the hand-computable FakeRunner."""

from __future__ import annotations

import argparse

import pytest
from fake_runner import FakeRunner, check_invariants, make_request, reference_output, run

from jaxpaged.args import EngineArgs
from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.models.testing import tiny_config
from jaxpaged.sched.prefill_cap import prefill_cap
from jaxpaged.sched.scheduler import Scheduler


def make(cap, *, budget=64, max_num_seqs=8, step_sizes=(), fit=False):
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=256,
            max_prefill_tokens_with_decodes=cap,
            fit_prefill_to_buckets=fit,
        ),
        CacheConfig(block_size=4),
        num_blocks=64,
        step_sizes=step_sizes,
    )
    return sched, FakeRunner(64, 4, scheduler=sched)


def step(sched, runner):
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    check_invariants(sched)
    return {s.request_id: len(s.token_ids) for s in out.seqs}


def test_a_prompt_arriving_among_decodes_is_fed_in_capped_chunks():
    sched, runner = make(cap=8)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    assert step(sched, runner) == {"a": 3}
    prompt = list(range(1, 31))  # 30 tokens: chunks of 8, 8, 8, 6 beside a's decodes
    sched.add_request(make_request("b", prompt, max_tokens=3))
    fed = [step(sched, runner) for _ in range(5)]
    assert fed == [{"a": 1, "b": 8}, {"a": 1, "b": 8}, {"a": 1, "b": 8}, {"a": 1, "b": 6},
                   {"a": 1, "b": 1}]  # fmt: skip
    outputs = run(sched, runner)
    assert outputs["b"] == reference_output(prompt, 3)
    assert sched.requests == {} and sched.pool.num_free_blocks == sched.pool.num_blocks


def test_without_decodes_a_prefill_takes_the_whole_budget():
    sched, runner = make(cap=8, budget=64)
    sched.add_request(make_request("a", list(range(1, 41)), max_tokens=2))
    sched.add_request(make_request("b", list(range(2, 42)), max_tokens=2))
    # no request decodes yet: a whole 40-token prompt and 24 of the next
    assert step(sched, runner) == {"a": 40, "b": 24}
    # a decodes now: b's last 16 prompt tokens in two capped chunks
    assert step(sched, runner) == {"a": 1, "b": 8}
    assert step(sched, runner) == {"b": 8}  # a finished (2 tokens): b alone, uncapped
    assert run(sched, runner)["b"] == reference_output(list(range(2, 42)), 2)


def test_waiting_prompts_share_the_cap():
    sched, runner = make(cap=8)
    sched.add_request(make_request("a", [1, 2], max_tokens=10))
    step(sched, runner)
    for k, rid in enumerate("bcd"):  # distinct prompts: no prefix-cache hits
        sched.add_request(make_request(rid, [10 * k + t for t in range(4, 10)], max_tokens=1))
    assert step(sched, runner) == {"a": 1, "b": 6, "c": 2}  # d waits: the cap is spent
    assert step(sched, runner) == {"a": 1, "c": 4, "d": 4}


SIZES = (16, 32, 64, 128, 256, 512)  # the runner's mixed-step token sizes at budget 512


@pytest.mark.parametrize(
    ("cap", "decodes", "expected"),
    [
        (64, 15, 49),  # 15 + 49 = 64 rows, not 79 padded to 128
        (64, 16, 48),
        (64, 1, 63),
        (64, 64, 64),  # 128 exactly
        (64, 40, 64),  # no size in 72..104: ending on one would drop more than half
        (64, 100, 64),
        (1, 5, 1),  # never 0: prefills always advance
        (512, 20, 492),  # uncapped: the budget's own limit
    ],
)
def test_the_cap_ends_the_step_on_a_compiled_size(cap, decodes, expected):
    assert prefill_cap(cap, decodes, SIZES) == expected
    assert prefill_cap(cap, decodes, ()) == cap


def test_caps_by_decodes_follow_the_steps_decodes():
    sched, runner = make(cap=None, budget=64)
    sched.set_prefill_caps((64, 5, 9))  # 5 tokens beside one decode, 9 beside two or more
    assert sched.config.max_prefill_tokens_with_decodes == 9
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    sched.add_request(make_request("c", [4, 5], max_tokens=2))
    assert step(sched, runner) == {"a": 3, "c": 2}  # no decode: the budget
    prompt = list(range(1, 31))
    sched.add_request(make_request("b", prompt, max_tokens=10))
    assert step(sched, runner) == {"a": 1, "c": 1, "b": 9}  # two decodes: 9
    assert step(sched, runner) == {"a": 1, "b": 5}  # c finished: one decode, 5
    sched.set_prefill_cap(4)  # a plain cap replaces the caps by decodes
    assert step(sched, runner) == {"a": 1, "b": 4}
    assert run(sched, runner)["b"] == reference_output(prompt, 10)
    for bad in ((64,), (64, 0), (64, 2.5)):
        with pytest.raises(ValueError, match="prefill caps"):
            sched.set_prefill_caps(bad)


def test_off_by_default_the_step_sizes_are_ignored():
    sched, runner = make(cap=16, step_sizes=(16, 32, 64))
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", list(range(1, 31)), max_tokens=3))
    assert step(sched, runner) == {"a": 1, "b": 16}


def test_the_scheduler_rounds_its_chunks_to_the_step_sizes():
    sched, runner = make(cap=16, step_sizes=(16, 32, 64), fit=True)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    assert step(sched, runner) == {"a": 3}
    prompt = list(range(1, 31))  # 1 decode + 15 prompt tokens = 16 rows, twice
    sched.add_request(make_request("b", prompt, max_tokens=3))
    fed = [step(sched, runner) for _ in range(3)]
    assert fed == [{"a": 1, "b": 15}, {"a": 1, "b": 15}, {"a": 1, "b": 1}]
    assert run(sched, runner)["b"] == reference_output(prompt, 3)
    assert sched.requests == {} and sched.pool.num_free_blocks == sched.pool.num_blocks


def test_no_cap_keeps_the_budget():
    sched, runner = make(cap=None, budget=64)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", list(range(1, 51)), max_tokens=1))
    assert step(sched, runner) == {"a": 1, "b": 50}


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64"])
def test_a_bad_cap_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        SchedulerConfig(max_prefill_tokens_with_decodes=bad)
    with pytest.raises(ValueError, match="fit_prefill_to_buckets"):
        SchedulerConfig(fit_prefill_to_buckets="yes")


def test_engine_args_default_and_flag():
    cfg = tiny_config()
    # by default none: the engine measures one at warm-up (test_prefill_budget.py)
    assert EngineArgs().scheduler_config(cfg).max_prefill_tokens_with_decodes is None
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--max-prefill-tokens-with-decodes", "512"]))
    assert args.scheduler_config(cfg).max_prefill_tokens_with_decodes == 512
    with pytest.raises(SystemExit):  # argparse: not a positive int
        parser.parse_args(["--max-prefill-tokens-with-decodes", "0"])
    assert not EngineArgs().scheduler_config(cfg).fit_prefill_to_buckets
    fit = EngineArgs.from_cli_args(parser.parse_args(["--fit-prefill-to-buckets"]))
    assert fit.scheduler_config(cfg).fit_prefill_to_buckets
