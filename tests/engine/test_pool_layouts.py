"""The runner's block moves over both KV pool layouts: two arrays (K, V) and the combined one
the "tpu" backend reads (one array, K and V per page, padded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config


@pytest.mark.parametrize("backend,arrays", [("xla", 2), ("tpu", 1)])
def test_swap_out_and_in_is_bit_exact_in_every_layer(backend, arrays):
    cfg = tiny_config(head_dim=16)
    params = jax.tree.map(jnp.asarray, random_params(cfg))
    engine = LLMEngine.from_params(
        cfg, params, attention_backend=backend, max_model_len=32, max_num_seqs=2,
        max_num_batched_tokens=16, num_kv_blocks=8, block_size=8, enforce_eager=True,
    )  # fmt: skip
    runner = engine.runner
    assert len(runner.pool) == arrays and engine.layout.combined == (backend == "tpu")
    rng = np.random.default_rng(0)
    runner.pool = tuple(jnp.asarray(rng.standard_normal(p.shape), p.dtype) for p in runner.pool)
    before = [np.asarray(p) for p in runner.pool]
    runner.moves.swap_out(runner.pool, [(3, 0), (5, 1)])  # device block -> host slot
    runner.pool = tuple(jnp.zeros_like(p) for p in runner.pool)
    runner.pool = runner.moves.swap_in(runner.pool, [(0, 6), (1, 2)])  # host slot -> device block
    layers, blocks = engine.layout.num_layers, engine.layout.num_blocks
    for old, new in zip(before, (np.asarray(p) for p in runner.pool), strict=True):
        for layer in range(layers):
            row = layer * blocks
            np.testing.assert_array_equal(new[row + 6], old[row + 3])
            np.testing.assert_array_equal(new[row + 2], old[row + 5])
    assert runner.num_host_blocks_in_use == 0
