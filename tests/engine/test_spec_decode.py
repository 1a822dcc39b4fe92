"""N-gram speculative decoding in the engine, on a tiny random model: greedy output is
token-identical to the engine without it (batched, chunked prefill, prefix caching, both
preemption modes), seeded sampling too with the target's logprobs, no compilation after
warm-up, and every block back in the pool after each test. One engine per configuration,
built once for the module."""

from __future__ import annotations

import random

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config

# drafting at every batch size (a CPU engine's default drafts for one request only)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 64}  # fmt: skip
# block_size 4 and a 16-token budget: prompts span blocks and prefill in chunks; 28 blocks
# are too few for four requests at once: they are preempted. One pool size for every
# engine, so they share compiled programs.
BASE = dict(max_model_len=80, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
            max_prefill_tokens_with_decodes=16, num_kv_blocks=28, show_progress=False)  # fmt: skip


def _llm(**kwargs) -> LLM:
    config = tiny_config()
    engine = LLMEngine.from_params(config, random_params(config, seed=1), **{**BASE, **kwargs})
    return LLM.from_engine(engine)


@pytest.fixture(scope="module")
def plain():
    llm = _llm()
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def spec():
    llm = _llm(speculative_config=SPEC)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(96) for _ in range(10)]  # a common prefix: prefix-cache hits
    return [shared + [rng.randrange(96) for _ in range(rng.randint(2, 30))] for _ in range(6)]


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _pool_is_whole(llm: LLM) -> None:
    pool = llm.engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.tracked_request_ids()


def test_greedy_identical_batched_chunked_prefix_cached_preempted(plain, spec, prompts):
    params = [SamplingParams(temperature=0, max_tokens=10 + 7 * i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    want = _ids(plain.generate(prompts, params))
    assert _ids(spec.generate(prompts, params)) == want
    assert _ids(spec.generate(prompts, params)) == want  # again: from the prefix cache
    m = spec.get_metrics()
    assert m["prefix_cache_hits"] > 0 and m["num_preemptions"] > 0
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert 0 < m["spec_decode_acceptance_rate"] < 1
    assert m["num_compilations_after_warmup"] == 0
    _pool_is_whole(spec)


def test_stop_token_and_max_tokens_inside_runs(plain, spec, prompts):
    """A stop token (ended like EOS) met inside a run of accepted drafts, and short
    max_tokens, end the output where the engine without speculation ends it."""
    free = _ids(plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30)))
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[out[12 + i]])
        for i, out in enumerate(free)
    ] + [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 5)]
    batch = prompts + prompts[:3]
    assert _ids(spec.generate(batch, params)) == _ids(plain.generate(batch, params))
    assert spec.get_metrics()["num_compilations_after_warmup"] == 0
    _pool_is_whole(spec)


def test_seeded_sampling_and_logprobs_identical(plain, spec, prompts):
    """Position j of a verification samples from the stream of that output index, so with a
    seed the tokens are those of the engine without speculation; logprobs are the target's."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, logprobs=3)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert _ids(got) == _ids(want)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top.keys() == b.top.keys()
    _pool_is_whole(spec)


def test_requests_with_sampler_state_or_speculation_off_do_not_draft(plain, spec, prompts):
    """Penalties, min_tokens and logit_bias read per-request state that would have to follow
    every draft: such requests decode one token a step beside drafting ones (vLLM serves
    the requests speculation does not support without it), as does a request that turned
    speculation off; their outputs are the engine's without speculation."""
    before = spec.get_metrics()["spec_decode_num_drafts"]
    params = [
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=15, stop_token_ids=[1]),
        SamplingParams(temperature=0, max_tokens=20, logit_bias={5: 3.0}),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False),
    ]
    assert _ids(spec.generate(prompts[:4], params)) == _ids(plain.generate(prompts[:4], params))
    assert spec.get_metrics()["spec_decode_num_drafts"] == before
    mixed = params + [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    assert _ids(spec.generate(prompts[:5], mixed)) == _ids(plain.generate(prompts[:5], mixed))
    assert spec.get_metrics()["spec_decode_num_drafts"] > before
    assert spec.get_metrics()["num_compilations_after_warmup"] == 0
    _pool_is_whole(spec)


def test_greedy_identical_under_swap_preemption(plain, prompts):
    """Last in the module: it builds an engine, whose warm-up the others' compile counts
    (process-wide) would see."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = _llm(preemption_mode="swap", speculative_config=SPEC)
    try:
        assert _ids(small.generate(prompts, params)) == _ids(plain.generate(prompts, params))
        m = small.get_metrics()
        assert m["num_preemptions"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
        assert m["num_compilations_after_warmup"] == 0
        _pool_is_whole(small)
    finally:
        small.close()


def test_cpu_default_drafts_for_one_request_only(spec):
    """A CPU engine given no disable_by_batch_size drafts only while one request runs (where
    bench/speculative.py measured a gain); a value given is kept."""
    from jaxpaged.engine.engine_setup import CPU_SPEC_MAX_BATCH, spec_defaults
    from jaxpaged.spec import SpeculativeConfig

    assert spec.engine.scheduler.speculative_config.disable_by_batch_size == 64
    unset = SpeculativeConfig(num_speculative_tokens=2)
    assert spec_defaults(unset, "cpu").disable_by_batch_size == CPU_SPEC_MAX_BATCH
    assert spec_defaults(unset, "gpu").disable_by_batch_size is None
