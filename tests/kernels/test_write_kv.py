"""write_kv writes exactly the given slots, skips negative ones, and works in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu, write_kv
from jaxpaged.kernels.testing import DTYPES


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_exact_slots(rng, dtype):
    nb, bs, hkv, d, t = 12, 8, 2, 16, 20
    kp = rng.standard_normal((nb, bs, hkv, d)).astype(DTYPES[dtype])
    vp = rng.standard_normal((nb, bs, hkv, d)).astype(DTYPES[dtype])
    slots = rng.choice(nb * bs, size=t, replace=False).astype(np.int32)
    slots[rng.choice(t, size=5, replace=False)] = -rng.integers(1, 1000, size=5)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    new_k, new_v = jax.jit(write_kv)(*map(jnp.asarray, (kp, vp, k, v, slots)))
    want_k = kp.reshape(nb * bs, hkv, d).copy()
    want_v = vp.reshape(nb * bs, hkv, d).copy()
    keep = slots >= 0
    want_k[slots[keep]] = k[keep].astype(want_k.dtype)
    want_v[slots[keep]] = v[keep].astype(want_v.dtype)
    assert new_k.dtype == kp.dtype
    np.testing.assert_array_equal(np.asarray(new_k).reshape(nb * bs, hkv, d), want_k)
    np.testing.assert_array_equal(np.asarray(new_v).reshape(nb * bs, hkv, d), want_v)


def _skip_without_native_write(dtype):
    if dtype == "bfloat16" and jax.default_backend() == "cpu" and not cpu.available():
        pytest.skip("bfloat16 pools on CPU are written in place by the native kernel only")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_in_place_under_donation(rng, dtype):
    """The compiled program aliases the pools to the outputs and needs no pool-sized temp
    (for bfloat16 on CPU XLA's own scatter converted the whole pool to float32 and back)."""
    _skip_without_native_write(dtype)
    nb, bs, hkv, d, t = 256, 16, 3, 64, 32
    dt = DTYPES[dtype]
    pool_bytes = nb * bs * hkv * d * jnp.dtype(dt).itemsize
    kp = jnp.zeros((nb, bs, hkv, d), dt)
    vp = jnp.zeros((nb, bs, hkv, d), dt)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
    slots = jnp.asarray(rng.choice(nb * bs, size=t, replace=False), jnp.int32)
    fn = jax.jit(write_kv, donate_argnums=(0, 1))
    compiled = fn.lower(kp, vp, k, k, slots).compile()
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == 2 * pool_bytes
    assert stats.temp_size_in_bytes < pool_bytes // 8
    ptr = kp.unsafe_buffer_pointer()
    new_k, _ = fn(kp, vp, k, k, slots)
    assert new_k.unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(
        np.asarray(new_k).reshape(-1, hkv, d)[np.asarray(slots)], np.asarray(k.astype(dt))
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_in_a_layer_scan_stays_in_place(rng, dtype):
    """As the decoder runs it: a scan over layers, each writing its rows at its own offset
    into the one donated pool, with no pool-sized temp; every layer's rows land."""
    _skip_without_native_write(dtype)
    layers, nb, bs, hkv, d, t = 4, 64, 16, 3, 64, 8
    dt = DTYPES[dtype]
    pool_bytes = layers * nb * bs * hkv * d * jnp.dtype(dt).itemsize
    kp = jnp.zeros((layers * nb, bs, hkv, d), dt)
    rows = jnp.asarray(rng.standard_normal((layers, t, hkv, d)), jnp.float32)
    slots = jnp.asarray(rng.choice(nb * bs, size=t, replace=False), jnp.int32)

    def run(kp, vp, rows, slots):
        def body(pool, xs):
            layer, r = xs
            return write_kv(*pool, r, -r, slots + layer * nb * bs), None

        return jax.lax.scan(body, (kp, vp), (jnp.arange(layers), rows))[0]

    fn = jax.jit(run, donate_argnums=(0, 1))
    stats = fn.lower(kp, kp, rows, slots).compile().memory_analysis()
    assert stats.temp_size_in_bytes < pool_bytes // 8, stats.temp_size_in_bytes
    new_k, new_v = fn(kp, jnp.zeros_like(kp), rows, slots)
    got_k = np.asarray(new_k).reshape(layers, nb * bs, hkv, d)
    got_v = np.asarray(new_v).reshape(layers, nb * bs, hkv, d)
    want = np.asarray(rows.astype(dt))
    for layer in range(layers):
        np.testing.assert_array_equal(got_k[layer, np.asarray(slots)], want[layer])
        np.testing.assert_array_equal(got_v[layer, np.asarray(slots)], -want[layer])


def test_write_kv_rejects_bad_shapes():
    kp = jnp.zeros((4, 8, 2, 16))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(kp, kp, jnp.zeros((3, 2, 16)), jnp.zeros((3, 2, 16)), jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="k must be"):
        write_kv(kp, kp, jnp.zeros((3, 4, 16)), jnp.zeros((3, 4, 16)), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="v_pages"):
        write_kv(
            kp, kp[:2], jnp.zeros((3, 2, 16)), jnp.zeros((3, 2, 16)), jnp.zeros((3,), jnp.int32)
        )
