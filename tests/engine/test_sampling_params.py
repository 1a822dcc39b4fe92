"""SamplingParams / validate_prompt / CacheConfig / SchedulerConfig validation: each bad value
raises ValueError naming its field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from jaxpaged.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from jaxpaged.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, validate_prompt


def test_defaults_are_valid_and_hashable():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.n, sp.max_tokens) == (
        1.0,
        1.0,
        -1,
        0.0,
        1,
        16,
    )
    assert not sp.greedy and SamplingParams(temperature=0).greedy
    hash(sp)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # type: ignore[misc]  # keyword-only


def test_sequence_fields_are_normalised_to_tuples():
    sp = SamplingParams(stop="###", stop_token_ids=[2, 3])
    assert sp.stop == ("###",) and sp.stop_token_ids == (2, 3)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    hash(sp)


BAD = [
    ("temperature", -0.1),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", math.nan),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1.5),
    ("min_tokens", -1),
    ("n", 0),
    ("n", MAX_N + 1),
    ("n", True),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("seed", 1.5),
    ("seed", "42"),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_each_bad_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_min_tokens_over_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(min_tokens=100, max_tokens=None)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0},
        {"top_p": 1e-6},
        {"top_k": 1},
        {"min_p": 1.0},
        {"repetition_penalty": 1.5},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"n": MAX_N},
        {"seed": -7},
        {"max_tokens": None},
    ],
)
def test_edge_values_are_accepted(kw):
    SamplingParams(**kw)


def test_effective_max_tokens():
    assert SamplingParams(max_tokens=10).effective_max_tokens(5, 100) == 10
    assert SamplingParams(max_tokens=None).effective_max_tokens(5, 100) == 95


def test_validate_prompt():
    sp = SamplingParams(max_tokens=4)
    validate_prompt([0, 1, 99], 8, 100, sp)
    with pytest.raises(ValueError, match="^prompt must not be empty"):
        validate_prompt([], 8, 100, sp)
    with pytest.raises(ValueError, match="^prompt is 8 tokens long"):
        validate_prompt([1] * 8, 8, 100)
    validate_prompt([1] * 7, 8, 100)  # max_model_len - 1 is fine on its own
    with pytest.raises(ValueError, match="^max_tokens"):
        validate_prompt([1] * 5, 8, 100, sp)
    validate_prompt([1] * 4, 8, 100, sp)
    validate_prompt([1] * 7, 8, 100, SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="^prompt token 2 has id 100"):
        validate_prompt([1, 2, 100], 8, 100)
    with pytest.raises(ValueError, match="^prompt token 0 has id -1"):
        validate_prompt([-1], 8, 100)
    with pytest.raises(ValueError, match="^prompt token 1 is not an int"):
        validate_prompt([1, "a"], 8, 100)


def test_cache_config_validation():
    c = CacheConfig()
    assert (c.block_size, c.num_kv_blocks, c.enable_prefix_caching) == (16, None, True)
    assert CacheConfig(swap_space=1).num_host_blocks(1 << 20) == 1024
    assert CacheConfig(swap_space=0).num_host_blocks(1000) == 0
    for field, value in [
        ("block_size", 0),
        ("num_kv_blocks", 0),
        ("kv_cache_memory", -1),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("swap_space", -1),
        ("enable_prefix_caching", "yes"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}"):
            CacheConfig(**{field: value})
    with pytest.raises(ValueError, match="^bytes_per_block"):
        c.num_host_blocks(0)


def test_scheduler_and_parallel_config_validation():
    s = SchedulerConfig()
    assert s.preemption_mode == "recompute"
    for field, value in [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 1),
        ("preemption_mode", "drop"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}"):
            SchedulerConfig(**{field: value})
    with pytest.raises(ValueError, match="^tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    assert ModelConfig.__module__ == "jaxpaged.models.config"
