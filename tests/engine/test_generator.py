"""jaxpaged.Generator: generate() calls in a loop reuse one engine per (config, params shapes,
settings), swap in new params without compiling, and equal what a fresh engine generates."""

from __future__ import annotations

import jax
import pytest

import jaxpaged
from jaxpaged import SamplingParams
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.worker.compile_counter import CompileCounter

# four warm-up step programs per engine (decode 1, 2; mixed 16, 32): the second prompt is
# prefilled in two chunks
SETTINGS = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=24)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 9, 2, 7], list(range(3, 40))]


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_generator_reuses_its_engine_across_calls():
    config = tiny_config()
    p0, p1 = random_params(config, seed=0), random_params(config, seed=1)
    want1 = _tokens(jaxpaged.generate(PROMPTS, GREEDY, params=p1, config=config, **SETTINGS))
    with jaxpaged.Generator() as gen:
        kwargs = dict(config=config, generator=gen, **SETTINGS)
        want0 = _tokens(jaxpaged.generate(PROMPTS, GREEDY, params=p0, **kwargs))
        llm = gen.llm(params=p0, config=config, **SETTINGS)
        with CompileCounter() as compiles:
            got1 = _tokens(jaxpaged.generate(PROMPTS, GREEDY, params=jax.device_put(p1), **kwargs))
            got0 = _tokens(jaxpaged.generate(PROMPTS, GREEDY, params=p0, **kwargs))
        assert compiles.count == 0
        assert gen.engines_built == 1
        assert got1 == want1 and got0 == want0 and want0 != want1
        # other settings: another engine, the first one closed (max_engines=1)
        jaxpaged.generate(PROMPTS[:1], GREEDY, params=p0, config=config, generator=gen,
                          **{**SETTINGS, "num_kv_blocks": 20, "enforce_eager": True})  # fmt: skip
        assert gen.engines_built == 2
        assert llm.engine._compiles._open is False
    with pytest.raises(ValueError, match="max_engines"):
        jaxpaged.Generator(max_engines=0)
