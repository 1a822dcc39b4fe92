"""Decoder embedders through the paged engine: pooling requests are prefills in the
generation engine's own steps whose last prompt token's final hidden state comes back.
Checked against transformers' hidden states on tiny random Qwen3 and Llama checkpoints:
one engine per model for the whole module (``LLM(runner="pooling")``, whose engine is a
paged LLMEngine), nothing compiled after warm-up, a long prompt split over steps, the
greedy tokens of generation requests sharing those steps unchanged, no block held after."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from decoders import ENGINE, VOCAB, hidden_states, save_causal

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.async_pooling import AsyncPoolingEngine
from jaxpaged.engine.paged_pooling import PagedPoolingWorker

FULL = os.environ.get("JAXPAGED_TEST_FULL") == "1"


# Llama (the same module without Qwen3's q/k norms) costs another warm-up: full suite only
@pytest.fixture(
    scope="module",
    params=[
        "qwen3",
        pytest.param("llama", marks=pytest.mark.skipif(not FULL, reason="JAXPAGED_TEST_FULL=1")),
    ],
)
def paged(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_causal(folder, request.param)
    with open(folder / "config_sentence_transformers.json", "w") as f:  # Qwen3-Embedding's form
        json.dump({"prompts": {"query": "w60 w61 ", "document": ""}}, f)
    with LLM(str(folder), runner="pooling", **ENGINE) as llm:
        assert isinstance(llm.engine.worker, PagedPoolingWorker)
        yield llm, hf


def _held(engine) -> int:
    """Blocks some request holds (the prefix cache's evictable blocks count as free)."""
    return engine.scheduler.pool.num_used_blocks


def test_embeddings_equal_transformers_last_token(paged):
    llm, hf = paged
    rng = np.random.default_rng(0)
    # 40 tokens: more than the 16 a step feeds, so its prefill runs over three steps
    prompts = [rng.integers(6, VOCAB, n).tolist() for n in (3, 40, 7, 1, 16, 11)]
    out = llm.embed(prompts)
    paged_engine = llm.engine.worker.engine
    for ids, o in zip(prompts, out, strict=True):
        h = hidden_states(hf, ids)[-1]
        got = np.array(o.outputs.embedding)
        assert o.prompt_token_ids == ids
        assert float(got @ h) / np.linalg.norm(h) >= 0.999
        np.testing.assert_allclose(got, h / np.linalg.norm(h), atol=2e-5)
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0
    assert _held(paged_engine) == 0 and not paged_engine.has_unfinished_requests()
    served = AsyncPoolingEngine(llm.engine).engine_config  # what the server logs
    assert served["dtype"] == "float32" and served["pooling"] == "last"
    with pytest.raises(ValueError, match="needs runner='generate'"):
        llm.generate(["w6"])
    with pytest.raises(ValueError, match="maximum input length of 63"):  # 64: 1 to sample
        llm.embed([[7] * 64])


def test_pooling_shares_steps_with_generation(paged):
    """Generation requests and pooling requests in the same steps: the greedy tokens are
    those of the generation alone, the hidden states transformers', and every block is
    back once all are done."""
    llm, hf = paged
    engine = llm.engine.worker.engine
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    gen_prompts = [[9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    alone = {}
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"alone-{i}", p, greedy)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                alone[out.request_id] = out.outputs[0].token_ids
    engine.reset_prefix_cache()
    rng = np.random.default_rng(1)
    pool_prompts = [rng.integers(6, VOCAB, n).tolist() for n in (5, 30, 2)]
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", p, greedy)
    engine.step()  # the generation prompts go first; the pooling ones join their decodes
    for i, p in enumerate(pool_prompts):
        engine.add_pooling_request(f"emb-{i}", p)
    mixed, pooled, steps_with_both = {}, {}, 0
    while engine.has_unfinished_requests():
        generating = sum(1 for i in range(2) if f"gen-{i}" not in mixed)
        waiting = sum(1 for i in range(3) if f"emb-{i}" not in pooled)
        for out in engine.step():
            assert out.request_id.startswith("gen-")  # pooling requests have no step output
            if out.finished:
                mixed[out.request_id] = out.outputs[0].token_ids
        for i in range(3):
            done = engine.take_pooled(f"emb-{i}")
            if done is not None:
                pooled[f"emb-{i}"] = done.hidden
        steps_with_both += generating > 0 and waiting > 0
    assert steps_with_both >= 3
    assert [mixed[f"gen-{i}"] for i in range(2)] == [alone[f"alone-{i}"] for i in range(2)]
    for i, p in enumerate(pool_prompts):
        h = hidden_states(hf, p)[-1]
        np.testing.assert_allclose(pooled[f"emb-{i}"], h, atol=1e-4, rtol=1e-4)
    assert _held(engine) == 0
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_pooling_request("bad", [])
    engine.add_pooling_request("gone", list(range(6, 36)))  # aborted mid-prefill
    engine.step()
    engine.abort("gone")
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert engine.take_pooled("gone") is None and _held(engine) == 0


def test_named_prompt_goes_before_the_text(paged):
    """sentence-transformers' prompts (config_sentence_transformers.json): prompt_name puts
    the named text before each text input, as its encode(prompt_name=...) does."""
    llm, _ = paged
    with_prompt = llm.embed(["w7 w8", "w9"], prompt_name="query")
    by_hand = llm.embed(["w60 w61 w7 w8", "w60 w61 w9"])
    for a, b in zip(with_prompt, by_hand, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids == [60, 61, *a.prompt_token_ids[2:]]
        np.testing.assert_allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-6)
    assert llm.embed(["w9"], prompt_name="document")[0].prompt_token_ids == [9]
    with pytest.raises(ValueError, match="prompt_name 'passage' is not one of .*'query'"):
        llm.embed(["w9"], prompt_name="passage")
