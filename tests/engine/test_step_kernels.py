"""Which kernels the engine's steps use (the platform backend, chosen once per engine), and
that the native matmul gives the same model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu
from jaxpaged.kernels.cpu.backend import CpuBackend
from jaxpaged.kernels.cpu.features import has_bf16_dot
from jaxpaged.kernels.platform import AttentionShape, XlaBackend, choose_platform
from jaxpaged.kernels.step_kernels import StepKernels
from jaxpaged.models.linear import map_matmul_weights
from jaxpaged.models.llama import LINEARS, compute_logits, forward, linear_xla
from jaxpaged.models.testing import random_params, tiny_config

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernels")

NATIVE = StepKernels(linear=cpu.linear, argmax=cpu.argmax)
NATIVE_ARGMAX = StepKernels(argmax=cpu.argmax)


def _weight_map(cfg):
    del cfg  # every Llama config's linears are the family's one declaration
    return lambda params, fn: map_matmul_weights(params, LINEARS, fn)


def _backend(params, cfg, attention_backend=None, *, sharded=False, platform="cpu"):
    """The layer implementation of the platform an engine over ``params`` gets."""
    dtype = jnp.dtype(jax.tree.leaves(params)[0].dtype).name
    shape = AttentionShape(
        num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        block_size=16, kv_dtype=dtype, q_dtype=dtype,
    )  # fmt: skip
    return choose_platform(
        params,
        _weight_map(cfg),
        device=platform,
        attention_backend=attention_backend,
        shape=shape,
        tensor_parallel=sharded,
        probe=lambda *args: None,
    ).layers


def _pack(params, cfg):
    backend = _backend(params, cfg)
    assert backend.kernels.linear is cpu.linear and backend.kernels.argmax is cpu.argmax
    return backend.pack_weights(params, _weight_map(cfg))


def test_float32_or_bfloat16_single_cpu_device_uses_the_native_kernels():
    """Both dtypes take the native kernels; bfloat16 params keep float32 activations, since
    the native matmul computes in float32 on every CPU."""
    cfg = tiny_config()
    f32 = random_params(cfg)
    bf16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), f32)
    native = dict(native_attention=True, native_linear=True, native_argmax=True)
    for params, attention_backend, act in (
        (f32, None, None), (f32, "cpu", None), (bf16, None, "float32"),
    ):  # fmt: skip
        backend = _backend(params, cfg, attention_backend)
        assert backend == CpuBackend(**native, activation_dtype=act, bf16_dot=has_bf16_dot())
        assert backend.kernels == StepKernels(
            linear=cpu.linear, argmax=cpu.argmax, activation_dtype=act
        )


def test_other_setups_use_xla():
    cfg = tiny_config()
    f32 = random_params(cfg)
    f16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float16), f32)
    assert _backend(f16, cfg).kernels == NATIVE_ARGMAX  # no float16 matmul kernel
    assert _backend(f32, cfg, "xla").kernels == StepKernels()  # kernels forced to XLA
    # sharded weights: XLA's SPMD dots
    assert _backend(f32, cfg, sharded=True).kernels == StepKernels()
    odd = tiny_config(vocab_size=100)  # an output size the panels cannot tile
    assert _backend(random_params(odd), odd).kernels == NATIVE_ARGMAX


def test_accelerators_get_xla_and_their_weights_as_loaded():
    cfg = tiny_config()
    params = random_params(cfg)
    backend = _backend(params, cfg, platform="gpu")
    assert backend == XlaBackend() and backend.kernels == StepKernels()
    assert backend.pack_weights(params, _weight_map(cfg)) is params
    assert backend.back_with_huge_pages(jax.tree.leaves(params)) == 0
    # unpacked: the XLA backend's params are the CPU backend's before packing
    assert _backend(params, cfg, "xla").pack_weights(params, _weight_map(cfg)) is params


def test_engine_steps_call_the_native_kernels():
    """An engine on CPU: its runner holds packed weights, and the compiled step calls the
    native attention, matmul and argmax (the FFI targets appear in its program)."""
    from jaxpaged.engine import LLMEngine
    from jaxpaged.worker.step import step

    cfg = tiny_config(max_position_embeddings=64)
    params = jax.tree.map(jnp.asarray, random_params(cfg))
    engine = LLMEngine.from_params(
        cfg, params, max_num_seqs=2, num_kv_blocks=16, block_size=8, enforce_eager=True,
        show_progress=False,
    )  # fmt: skip
    try:
        runner = engine.runner
        assert runner.kernels == NATIVE
        w = runner.params["layers"]["w_down"]
        np.testing.assert_array_equal(
            np.asarray(w), np.asarray(cpu.pack_panels(params["layers"]["w_down"]))
        )
        bucket = runner.buckets.all()[0]
        batch, _ = runner.build_batch([], bucket)
        hlo = step.lower(
            runner.params, runner.pool, runner.seq_state, runner.sampled, batch,
            **runner._step_kwargs(),
        ).as_text()  # fmt: skip
        for target in ("jaxpaged_paged_attention", "jaxpaged_linear", "jaxpaged_argmax"):
            assert target in hlo, target
    finally:
        engine.close()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 7, 130])
def test_packed_params_with_the_native_matmul_match_xla(tied, num_tokens):
    """The whole decoder and the logits: packed weights + cpu.linear against the original
    weights + XLA's dots, on random weights and tokens."""
    cfg = tiny_config(tie_word_embeddings=tied)
    params = random_params(cfg, seed=num_tokens, scale=0.2)
    packed = _pack(params, cfg)
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
    native = jax.jit(lambda p: run(p, cpu.linear, logits_fn))(_pack(bf16, cfg))
    assert native.dtype == jnp.float32

    def rms_err(got):  # relative to the logits' own RMS
        return float(np.sqrt(np.mean((np.asarray(got) - exact) ** 2) / np.mean(exact**2)))

    err_native, err_xla = rms_err(native), rms_err(xla_bf16)
    assert err_native < 0.02, err_native
    assert err_native <= 2.5 * err_xla, (err_native, err_xla)


@pytest.mark.parametrize("num_tokens", [1, 130])
def test_bfloat16_weights_with_float32_activations_compute_exactly_in_float32(num_tokens):
    """bfloat16 storage, float32 compute: the bf16 params through the native matmul with
    float32 activations (what the CPU backend picks) give the logits of the same weights
    widened to float32 through XLA's float32 dots, up to summation order; the embedding
    lookup, norms and rotary never round to bfloat16 in between."""
    cfg = tiny_config()
    bf16 = jax.tree.map(
        lambda a: jnp.asarray(a, jnp.bfloat16), random_params(cfg, seed=7 + num_tokens, scale=0.2)
    )
    widened = jax.tree.map(lambda a: a.astype(jnp.float32), bf16)
    tokens = jax.random.randint(jax.random.key(3), (num_tokens,), 0, cfg.vocab_size)
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    backend = _backend(bf16, cfg)
    kernels = backend.kernels
    assert kernels.activation_dtype == "float32"

    def native(p):
        hidden, _ = forward(p, tokens, positions, config=cfg, **kernels.model_kwargs(num_tokens))
        assert hidden.dtype == jnp.float32
        return compute_logits(p, hidden, config=cfg, linear_fn=kernels.logits_fn(num_tokens))

    def exact(p):
        hidden, _ = forward(p, tokens, positions, config=cfg, linear_fn=linear_xla)
        return compute_logits(p, hidden, config=cfg)

    want = np.asarray(jax.jit(exact)(widened))
    got = np.asarray(jax.jit(native)(backend.pack_weights(bf16, _weight_map(cfg))))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
