"""Structured output with drafts made on the device (a draft model, an EAGLE-3 head), on a
tiny random model over the bundled SmolLM2 tokenizer's vocabulary: the runner reads the
drafts back before the verification step, a copy of the grammar matcher walks them and each
verified position is sampled under its own mask (jaxpaged.worker.spec_grammar). Greedy
output equals the engine's without speculation (``SamplingParams.speculative=False``),
token for token, beside a plain drafting request, and the grammar request's drafts are
accepted. The grammars are token-level Lark (``<[id]>``) so that
the drafters' picks obey them often enough to be accepted and to be rejected mid-run:
without the walk (a verified position masked as the first, or after the placeholder
tokens) the outputs differ."""

from __future__ import annotations

import dataclasses

import pytest
import transformers
from eagle3_heads import write_eagle3_head

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.sampling_params import StructuredOutput
from jaxpaged.spec import SpeculativeConfig

CONFIG = tiny_config(vocab_size=49152)  # the bundled tokenizer's
K = 3
MAX_TOKENS = 16
SCHED = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
             max_prefill_tokens_with_decodes=32)  # fmt: skip
CACHE = dict(block_size=8, num_kv_blocks=32)
A, B = 1043, 2219  # the EAGLE-3 head's whole draft vocabulary
PROMPTS = [[77, 901, 3344, 12, 517, 8842, 40], [5, 6, 7, 8] * 3]


def _engine(params, tokenizer, **kw) -> LLM:
    engine = LLMEngine(
        model_config=CONFIG,
        params=params,
        tokenizer=tokenizer,
        scheduler_config=SchedulerConfig(**SCHED),
        cache_config=CacheConfig(**CACHE),
        eos_token_ids=[2],
        enforce_eager=True,
        show_progress=False,
        **kw,
    )
    return LLM.from_engine(engine)


@pytest.fixture(scope="module")
def setup(bundled_model_path, tmp_path_factory):
    from jaxpaged.models.eagle3 import load_eagle3

    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path)
    params = random_params(CONFIG, seed=2)
    head = tmp_path_factory.mktemp("eagle3")
    write_eagle3_head(head, target=CONFIG, keep=[A, B])
    spec = dict(num_speculative_tokens=K, disable_by_batch_size=8)
    made = {
        # the target drafting for itself: its drafts are its unconstrained greedy picks
        "draft_model": _engine(
            params,
            tokenizer,
            speculative_config=SpeculativeConfig(method="draft_model", model="in-memory", **spec),
            draft=(CONFIG, params),
        ),
        "eagle3": _engine(
            params,
            tokenizer,
            speculative_config=SpeculativeConfig(method="eagle3", model=str(head), **spec),
            eagle=load_eagle3(str(head)),
        ),
    }
    yield made
    for llm in made.values():
        llm.close()


def _grammar(method: str, plain_ids: list[int]) -> str:
    if method == "eagle3":  # after A only B: the head drafts A or B, the mask changes
        return f"start: (<[{B}]> | <[{A}]> <[{B}]>){{40,}}"
    # the target's own first tokens, then one it would not pick: drafts accepted, then
    # one rejected inside a verified run
    other = next(t for t in (A, B, 3) if t != plain_ids[4])
    lits = " ".join(f"<[{t}]>" for t in [*plain_ids[:4], other])
    return f"start: {lits} <[3-49151]>{{40,}}"


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_grammar_requests_draft_on_the_device_exactly(setup, method):
    """The reference: the same engine with speculation off per request (one token a step,
    the grammar's mask of that token only)."""
    spec = setup[method]
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    off = dataclasses.replace(free, speculative=False)
    unconstrained = spec.generate(PROMPTS, off)[0].outputs[0].token_ids
    so = StructuredOutput(grammar=_grammar(method, list(unconstrained)))
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_output=so), free]
    want = spec.generate(PROMPTS, [dataclasses.replace(p, speculative=False) for p in params])
    core = spec.engine.core
    advance, runs = core._advance_grammars, []  # the grammar request's tokens per step

    def spy(updates):
        runs.extend(len(u.new_token_ids) for u in updates if u.request_id in core.grammars)
        return advance(updates)

    core._advance_grammars = spy
    try:
        got = spec.generate(PROMPTS, params)
    finally:
        core._advance_grammars = advance
    for g, w in zip(got, want, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
    assert len(want[0].outputs[0].token_ids) == MAX_TOKENS
    assert max(runs) > 1, runs  # the grammar request's drafts were accepted
    pool = spec.engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks
