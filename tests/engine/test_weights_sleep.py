"""Weights swapped in place and sleep/wake, on a tiny random model.

After ``update_weights`` an engine must produce, token for token, what a fresh engine built on
the new weights produces (prefix cache included: a prompt cached under the old weights is
recomputed), without compiling anything; bad params are refused with a ValueError naming the
leaf and the engine keeps serving. ``sleep`` frees the KV pool (and at level 2 the weights),
refuses requests until ``wake_up``, and waking compiles nothing.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine import EngineAsleepError, LLMEngine
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.worker.compile_counter import CompileCounter

SETTINGS = dict(
    max_model_len=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    num_kv_blocks=24,
    show_progress=False,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# the first is 40 tokens long: two full blocks, so it is prefix-cached
PROMPTS = [list(range(3, 43)), [5, 9, 2, 7], [11, 12, 13, 14, 15, 16]]


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _fresh_tokens(params) -> list[list[int]]:
    """A fresh engine's tokens. Eager: it compiles only the shapes PROMPTS use (the same
    programs as the warmed-up engine's); the warm-up and its no-compile checks are ``llm``'s."""
    engine = LLMEngine.from_params(tiny_config(), params, enforce_eager=True, **SETTINGS)
    try:
        return _tokens(LLM.from_engine(engine))
    finally:
        engine.close()


@pytest.fixture(scope="module")
def weights():
    """Two sets of random params, and what a fresh engine generates on each."""
    p0, p1 = random_params(tiny_config(), seed=0), random_params(tiny_config(), seed=1)
    return p0, p1, _fresh_tokens(p0), _fresh_tokens(p1)


@pytest.fixture(scope="module")
def llm(weights):
    engine = LLMEngine.from_params(tiny_config(), weights[0], **SETTINGS)
    yield LLM.from_engine(engine)
    engine.close()


def test_update_weights_equals_a_fresh_engine_and_compiles_nothing(llm, weights):
    p0, p1, want0, want1 = weights
    assert want0 != want1  # the check below can fail
    assert _tokens(llm) == want0  # also caches PROMPTS[0]'s two blocks under p0
    device_p1 = jax.device_put(p1)  # already on the device: used as it is
    with CompileCounter() as compiles:
        llm.update_weights(device_p1)
        got1 = _tokens(llm)
        llm.update_weights(p0)  # host arrays are moved to the device
        got0 = _tokens(llm)
    assert got1 == want1
    assert got0 == want0
    assert compiles.count == 0
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: {**p, "embed": p["embed"][:, :16]}, r"params\['embed'\]: shape \(96, 16\)"),
        (lambda p: {**p, "final_norm": p["final_norm"].astype(np.float16)}, "float16"),
        (lambda p: {k: v for k, v in p.items() if k != "final_norm"}, "missing.*final_norm"),
    ],
)
def test_bad_params_are_refused_and_the_engine_keeps_serving(llm, weights, change, message):
    p0, _, want0, _ = weights
    with pytest.raises(ValueError, match=message):
        llm.update_weights(change(p0))
    llm.update_weights(p0)
    assert _tokens(llm) == want0


def test_params_on_the_device_are_used_in_place(weights):
    """Without kernel-specific packing (the XLA backend) the engine holds the caller's arrays
    themselves: no copy, no host round trip."""
    p0, p1, _, want1 = weights
    engine = LLMEngine.from_params(
        tiny_config(), p0, attention_backend="xla", enforce_eager=True, **SETTINGS
    )
    try:
        device_p1 = jax.device_put(p1)
        engine.update_weights(device_p1)
        held = jax.tree.leaves(engine.runner.params)
        assert all(a is b for a, b in zip(held, jax.tree.leaves(device_p1), strict=True))
        assert _tokens(LLM.from_engine(engine)) == want1
    finally:
        engine.close()


def test_sleep_frees_the_kv_pool_refuses_requests_and_wakes_up(llm, weights):
    p0, p1, want0, want1 = weights
    llm.update_weights(p0)
    layout = llm.engine.layout
    with CompileCounter() as compiles:
        freed = llm.sleep(level=1)
        assert freed >= layout.num_blocks * layout.bytes_per_block
        assert llm.engine.runner.pool is None
        with pytest.raises(EngineAsleepError, match="wake_up"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert _tokens(llm) == want0
        llm.sleep(level=2)
        assert llm.engine.runner.params is None
        with pytest.raises(RuntimeError, match="weights were dropped"):
            llm.wake_up()  # built on params in hand: nothing to reload them from
        llm.wake_up(p1)
        assert _tokens(llm) == want1
    assert compiles.count == 0
    assert llm.get_metrics()["num_free_blocks"] == layout.num_blocks


def test_sleep_is_refused_while_requests_run(llm, weights):
    engine = llm.engine
    engine.add_request("running", PROMPTS[1], GREEDY)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        engine.sleep(1)
    engine.abort("running")
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.sleep(1) > 0
    engine.wake_up()
    llm.update_weights(weights[0])
    assert _tokens(llm) == weights[2]
