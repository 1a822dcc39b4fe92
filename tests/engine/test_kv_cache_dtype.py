"""--kv-cache-dtype: the pool's sizing with 8-bit blocks plus scales, and the engine over an
int8/fp8 pool: block moves (swap, copy-on-write, shared prefixes) carry the scales."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.args import EngineArgs
from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.worker.kv_cache import KVLayout, num_blocks_for


def test_blocks_in_a_fixed_budget_grow_with_8bit_values():
    """SmolLM2's KV shape (30 layers, 3 KV heads of 64): an 8-bit block is 64 value bytes +
    4 scale bytes per (token, head) against 128 (bfloat16) and 256 (float32)."""
    cfg = tiny_config(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)
    budget = 1 << 30
    blocks = {
        dtype: num_blocks_for(
            cfg,
            block_size=16,
            dtype=dtype,
            max_model_len=2048,
            num_kv_blocks=None,
            kv_cache_memory=budget,
        )  # fmt: skip
        for dtype in ("float32", "bfloat16", "int8", "float8_e4m3fn")
    }
    per_block_8bit = 2 * 30 * 16 * 3 * (64 + 4)
    assert blocks["int8"] == blocks["float8_e4m3fn"] == budget // per_block_8bit
    assert blocks["bfloat16"] == budget // (2 * 30 * 16 * 3 * 128)
    assert 1.85 < blocks["int8"] / blocks["bfloat16"] < 1.9  # 128 / 68
    assert 3.7 < blocks["int8"] / blocks["float32"] < 3.8  # 256 / 68
    layout = KVLayout(num_layers=30, num_blocks=4, block_size=16, num_kv_heads=3, head_dim=64,
                      dtype="int8")  # fmt: skip
    assert layout.shapes == ((120, 16, 3, 64),) * 2 + ((120, 16, 3),) * 2
    assert layout.dtypes == (jnp.dtype(jnp.int8),) * 2 + (jnp.dtype(jnp.float32),) * 2


def test_cli_flag_and_bad_values():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8"]))
    assert args.cache_config().kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="float8").cache_config()


CFG = tiny_config(head_dim=16)


def _engine(kv_cache_dtype, **kw):
    params = jax.tree.map(jnp.asarray, random_params(CFG))
    opts = dict(
        attention_backend="xla", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
        num_kv_blocks=24, block_size=8, enforce_eager=True, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    return LLMEngine.from_params(CFG, params, **{**opts, **kw})


def test_tpu_backend_refuses_8bit_cache():
    with pytest.raises(ValueError, match="'tpu' attention backend cannot read a int8"):
        _engine("int8", attention_backend="tpu")


@pytest.mark.parametrize(
    "kind,dtypes",
    [
        ("int8", (jnp.int8,) * 2 + (jnp.float32,) * 2),
        ("bfloat16", (jnp.bfloat16,) * 2),  # of a float32 model
    ],
)
def test_swap_out_and_in_moves_values_and_scales(kind, dtypes):
    engine = _engine(kind)
    runner = engine.runner
    assert [p.dtype for p in runner.pool] == [jnp.dtype(d) for d in dtypes]
    rng = np.random.default_rng(0)
    runner.pool = tuple(
        jnp.asarray(rng.standard_normal(p.shape) * 50, jnp.float32).astype(p.dtype)
        for p in runner.pool
    )
    before = [np.asarray(p) for p in runner.pool]
    runner.moves.swap_out(runner.pool, [(3, 0), (5, 1)])
    runner.pool = tuple(jnp.zeros_like(p) for p in runner.pool)
    runner.pool = runner.moves.swap_in(runner.pool, [(0, 6), (1, 2)])
    rows = engine.layout.num_blocks
    for old, new in zip(before, (np.asarray(p) for p in runner.pool), strict=True):
        for layer in range(engine.layout.num_layers):
            np.testing.assert_array_equal(new[layer * rows + 6], old[layer * rows + 3])
            np.testing.assert_array_equal(new[layer * rows + 2], old[layer * rows + 5])


def _generate(engine, prompts, params):
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return [done[str(i)] for i in range(len(prompts))]


def test_shared_prefixes_and_copy_on_write_keep_scales():
    """Greedy outputs with prefix caching (shared blocks, copy-on-write of n=2 samples) equal
    those with every block computed afresh: a shared or copied 8-bit block carries its
    scales. Blocks are all free again at the end."""
    rng = np.random.default_rng(1)
    stem = rng.integers(1, 90, 20).tolist()
    prompts = [stem + rng.integers(1, 90, 3).tolist() for _ in range(3)] + [stem]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    ]
    outs = {}
    for caching in (True, False):
        engine = _engine("int8", enable_prefix_caching=caching)
        outs[caching] = _generate(engine, prompts, params)
        stats = engine.get_stats()
        if caching:
            assert stats.prefix_cache_hits > 0
        assert stats.num_free_blocks == stats.num_kv_blocks
        engine.close()
    assert outs[True] == outs[False]
