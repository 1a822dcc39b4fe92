"""Draft-model speculative decoding, on tiny random models: a draft that mostly agrees with
the target (its weights perturbed) proposes on the device; greedy and seeded outputs are
token-identical to the engine without speculation (batched, chunked prefill, prefix caching,
preemption), no compilation after warm-up, every block back in the pool. The bundled
SmolLM2's own 4-bit GGUF drafting for its float32 weights: test_spec_smollm.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.spec import SpeculativeConfig

CONFIG = tiny_config()
SCHED = SchedulerConfig(max_model_len=80, max_num_seqs=4, max_num_batched_tokens=16,
                        max_prefill_tokens_with_decodes=16)  # fmt: skip
CACHE = CacheConfig(block_size=4, num_kv_blocks=28)  # too few for 4 at once: preemption


def _llm(**kwargs) -> LLM:
    engine = LLMEngine(
        model_config=CONFIG,
        params=random_params(CONFIG, seed=1),
        tokenizer=None,
        scheduler_config=SCHED,
        cache_config=CACHE,
        show_progress=False,
        **kwargs,
    )
    return LLM.from_engine(engine)


def _draft_params():
    """The target's weights with noise: greedy picks mostly agree, not always."""
    rng = np.random.default_rng(5)

    def perturb(tree):
        if isinstance(tree, dict):
            return {k: perturb(v) for k, v in tree.items()}
        return (tree + rng.normal(0, 0.08, tree.shape)).astype(np.float32)

    return perturb(random_params(CONFIG, seed=1))


@pytest.fixture(scope="module")
def engines():
    plain = _llm()
    spec = SpeculativeConfig(method="draft_model", model="in-memory", num_speculative_tokens=3,
                              disable_by_batch_size=64)  # fmt: skip
    draft = _llm(speculative_config=spec, draft=(CONFIG, _draft_params()))
    yield plain, draft
    plain.close()
    draft.close()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(96) for _ in range(10)]
    return [shared + [rng.randrange(96) for _ in range(rng.randint(2, 30))] for _ in range(6)]


def _ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_draft_model_greedy_and_seeded_identical(engines, prompts):
    plain, draft = engines
    greedy = [SamplingParams(temperature=0, max_tokens=10 + 7 * i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    assert _ids(draft.generate(prompts, greedy)) == _ids(plain.generate(prompts, greedy))
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=20, stop_token_ids=[7])
    assert _ids(draft.generate(prompts, seeded)) == _ids(plain.generate(prompts, seeded))
    m = draft.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    assert m["num_compilations_after_warmup"] == 0
    pool = draft.engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.tracked_request_ids()
    # the two pools were planned together: the draft's has the target's block count
    assert draft.engine.runner.drafter.runner.layout.num_blocks == pool.num_blocks


def test_draft_must_share_the_vocabulary():
    spec = SpeculativeConfig(method="draft_model", model="in-memory", num_speculative_tokens=2)
    other = tiny_config(vocab_size=112)
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(speculative_config=spec, draft=(other, random_params(other, seed=0)))
