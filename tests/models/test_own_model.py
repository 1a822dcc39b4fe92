"""Bring your own model: the NNX module of examples/own_model.py (an architecture jaxpaged does
not ship) served by the paged engine must produce its own dense forward's greedy tokens, with
batching and chunked prefill; modules outside the protocol are refused by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

import jaxpaged
from jaxpaged import LLM, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_model.py"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8, 9], [20, 21, 22, 23, 24, 25, 26]]
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# a token budget of 8 splits the 11-token prompt's prefill into chunks and mixes prefill
# chunks with other sequences' decodes in one step
ENGINE = dict(max_model_len=64, num_kv_blocks=64, max_num_batched_tokens=8, enforce_eager=True)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("own_model_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model(example):
    return example.ParallelLM(example.tiny_config(), nnx.Rngs(0))


@pytest.fixture(scope="module")
def dense(example, model):
    return [example.dense_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def test_engine_matches_the_modules_dense_forward(model, dense):
    llm = LLM.from_model(model, **ENGINE)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.engine.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == dense
    assert len(set(map(tuple, dense))) == len(dense)  # the prompts lead different ways


def test_generate_with_params_serves_that_state(example, model, dense):
    """``params`` is a state of the module's graph (as research code holds after training):
    a different state gives that state's tokens, not the module's."""
    other = example.ParallelLM(example.tiny_config(), nnx.Rngs(1))
    state = nnx.state(other)
    outs = jaxpaged.generate(PROMPTS[:2], GREEDY, model=model, params=state, **ENGINE)
    want = [example.dense_greedy(other, p, MAX_TOKENS) for p in PROMPTS[:2]]
    assert [list(o.outputs[0].token_ids) for o in outs] == want != dense[:2]


def test_modules_outside_the_protocol_are_refused(example, model):
    class NoConfig(nnx.Module):
        def __call__(self, tokens, positions, attention_fn, cache):
            return jnp.zeros((tokens.shape[0], 4)), cache

    with pytest.raises(ValueError, match="config must be a jaxpaged.models.ModelConfig"):
        LLM.from_model(NoConfig())
    with pytest.raises(ValueError, match="must be a flax.nnx.Module"):
        LLM.from_model(lambda tokens: tokens)
    with pytest.raises(ValueError, match="not supported for a model of your own"):
        LLM.from_model(model, tensor_parallel_size=2, **ENGINE)
