"""KV-head replication and the per-leaf split, on one device (no mesh needed): the rewritten
params compute the same logits as the originals, and the split rules reject what N cannot
divide."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.distributed import parallel
from jaxpaged.models import compute_logits, forward, param_shapes
from jaxpaged.models.testing import random_params, tiny_config


@pytest.mark.parametrize(("num_kv_heads", "n"), [(2, 4), (2, 8), (1, 4), (4, 4)])
def test_replicated_heads_compute_the_same_logits(num_kv_heads: int, n: int) -> None:
    config = tiny_config(num_kv_heads=num_kv_heads)
    host = random_params(config)
    new_config, new_host = parallel.replicate_kv_heads(config, host, n)
    r = max(1, n // num_kv_heads)
    assert new_config.num_kv_heads == num_kv_heads * r
    assert new_config.num_heads == config.num_heads
    want_shapes = param_shapes(new_config)
    assert jax.tree.map(np.shape, new_host) == jax.tree.map(
        tuple, want_shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    # each replica holds an exact copy of its KV head's k and v columns
    g = config.queries_per_kv
    wqkv, new = host["layers"]["wqkv"], new_host["layers"]["wqkv"]
    for h in range(num_kv_heads * r):
        np.testing.assert_array_equal(new[:, h, -2:], wqkv[:, h // r, g:])

    tokens = jnp.array([3, 17, 42, 5, 77, 1], jnp.int32)
    positions = jnp.arange(6, dtype=jnp.int32)

    def logits(cfg, params):
        hidden, _ = forward(params, tokens, positions, config=cfg)
        return compute_logits(params, hidden, config=cfg)

    np.testing.assert_allclose(
        np.asarray(logits(new_config, new_host)),
        np.asarray(logits(config, host)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_split_rules() -> None:
    config = tiny_config()
    assert parallel.kv_replication(config, 2) == 1
    assert parallel.kv_replication(config, 4) == 2
    axes = parallel.split_axes(config)  # the Llama module's partition metadata
    spec = lambda path, shape, n: parallel.leaf_spec(path, shape, n, axes)  # noqa: E731
    assert spec("layers/wqkv", (2, 2, 6, 8, 32), 2) == jax.sharding.PartitionSpec(None, "tp")
    assert spec("layers/wo", (2, 32, 2, 4, 8), 2) == jax.sharding.PartitionSpec(None, None, "tp")
    assert spec("layers/w_down", (2, 32, 64), 2) == jax.sharding.PartitionSpec(None, None, "tp")
    assert spec("layers/attn_norm", (2, 32), 2) == jax.sharding.PartitionSpec()
    assert spec("embed", (96, 32), 4) == jax.sharding.PartitionSpec("tp")
    assert spec("embed", (97, 32), 4) == jax.sharding.PartitionSpec()  # vocab: replicated
    with pytest.raises(ValueError, match="layers/w_gate_up"):
        spec("layers/w_gate_up", (2, 2, 66, 32), 4)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        parallel.kv_replication(dataclasses.replace(config, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="exceeds"):
        parallel.make_mesh(jax.device_count() + 1)
