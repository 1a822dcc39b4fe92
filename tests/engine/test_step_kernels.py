"""Which matmul kernel the engine's steps use, and that the native one gives the same model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu
from jaxpaged.models.llama import compute_logits, forward, linear_xla
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.worker.step import pack_native_linear, use_native_linear

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernels")


def test_float32_or_bfloat16_single_cpu_device_uses_the_native_matmul():
    cfg = tiny_config()
    f32 = random_params(cfg)
    bf16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), f32)
    assert use_native_linear(f32, cfg, None, None)
    assert use_native_linear(f32, cfg, "cpu", None)
    assert use_native_linear(bf16, cfg, None, None)


def test_other_setups_use_xla():
    cfg = tiny_config()
    f32 = random_params(cfg)
    f16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float16), f32)
    assert not use_native_linear(f16, cfg, None, None)
    assert not use_native_linear(f32, cfg, "xla", None)  # kernels forced to XLA
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    assert not use_native_linear(f32, cfg, None, mesh)  # sharded weights: XLA's SPMD dots
    odd = tiny_config(vocab_size=100)  # an output size the panels cannot tile
    assert not use_native_linear(random_params(odd), odd, None, None)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 7, 130])
def test_packed_params_with_the_native_matmul_match_xla(tied, num_tokens):
    """The whole decoder and the logits: packed weights + cpu.linear against the original
    weights + XLA's dots, on random weights and tokens."""
    cfg = tiny_config(tie_word_embeddings=tied)
    params = random_params(cfg, seed=num_tokens, scale=0.2)
    packed = pack_native_linear(params, cfg)
    assert packed["embed"] is params["embed"]  # the lookup table stays as it is
    tokens = jax.random.randint(jax.random.key(1), (num_tokens,), 0, cfg.vocab_size)
    positions = jnp.arange(num_tokens, dtype=jnp.int32)

    def run(p, linear_fn, logits_fn):
        hidden, _ = forward(p, tokens, positions, config=cfg, linear_fn=linear_fn)
        return compute_logits(p, hidden, config=cfg, linear_fn=logits_fn)

    want = jax.jit(lambda p: run(p, linear_xla, None))(params)
    got = jax.jit(lambda p: run(p, cpu.linear, cpu.linear))(packed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("num_tokens", [1, 130])
def test_bfloat16_model_with_the_native_matmul_tracks_float32(num_tokens):
    """A bfloat16 model through the native kernel (bf16 weights read as such, float32
    accumulation) against the same bf16 weights computed in float32 with XLA: its logits
    stay as close as XLA's own bfloat16 dots get."""
    cfg = tiny_config()
    params = random_params(cfg, seed=num_tokens, scale=0.2)
    bf16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    widened = jax.tree.map(lambda a: a.astype(jnp.float32), bf16)
    tokens = jax.random.randint(jax.random.key(2), (num_tokens,), 0, cfg.vocab_size)
    positions = jnp.arange(num_tokens, dtype=jnp.int32)

    def run(p, linear_fn, logits_fn):
        hidden, _ = forward(p, tokens, positions, config=cfg, linear_fn=linear_fn)
        return compute_logits(p, hidden, config=cfg, linear_fn=logits_fn)

    exact = np.asarray(jax.jit(lambda p: run(p, linear_xla, None))(widened))
    xla_bf16 = np.asarray(jax.jit(lambda p: run(p, linear_xla, None))(bf16))
    logits_fn = functools.partial(cpu.linear, out_dtype=jnp.float32)
    native = jax.jit(lambda p: run(p, cpu.linear, logits_fn))(pack_native_linear(bf16, cfg))
    assert native.dtype == jnp.float32

    def rms_err(got):  # relative to the logits' own RMS
        return float(np.sqrt(np.mean((np.asarray(got) - exact) ** 2) / np.mean(exact**2)))

    err_native, err_xla = rms_err(native), rms_err(xla_bf16)
    assert err_native < 0.02, err_native
    assert err_native <= 2.5 * err_xla, (err_native, err_xla)
