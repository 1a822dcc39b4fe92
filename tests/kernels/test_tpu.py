"""The "tpu" backend (JAX's own TPU kernel over a combined K/V pool) in Pallas' TPU interpret
mode against the reference, on the randomized ragged sweep the other backends run.

Each interpreted case takes 15-30 s on 2 CPU cores (the TPU simulator runs every DMA and
load through a host callback), so a run checks one float32 and one bfloat16 case of the
sweep, drawn at random (the seed is printed); JAXPAGED_TPU_SWEEP=all runs every case and
the bundled SmolLM2 through the engine on this backend.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import ragged_paged_attention
from jaxpaged.kernels.testing import SWEEP, make_case, mixed_seqs, run_and_compare
from jaxpaged.kernels.tpu import (
    combine_kv,
    combined_pool_shape,
    pool_head_dim,
    pool_kv_heads,
    write_kv_combined,
)

# the kernel has no float16 path (TPUs have no float16 arithmetic): refused, tested below
TPU_SWEEP = [c for c in SWEEP if c[4] != "float16"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tpu_interpret_mixed_batch(rng, dtype):
    cases = [c for c in TPU_SWEEP if c[4] == dtype]
    if os.environ.get("JAXPAGED_TPU_SWEEP") != "all":
        cases = [cases[rng.integers(len(cases))]]
    for d, bs, hq, hkv, dtype, window, cap in cases:
        print("case", (d, bs, hq, hkv, dtype, window, cap))
        run_and_compare(
            rng, mixed_seqs(rng, bs), hq=hq, hkv=hkv, d=d, bs=bs, dtype=dtype, backend="tpu",
            max_seqs=8, sliding_window=window, soft_cap=cap,
        )  # fmt: skip


def test_pool_padding_follows_the_kernel_tiling():
    # the kernel tiles 2 * Hkv combined heads in 32-bit words: counts of 1, 2, 4, 8 or 8k
    assert [pool_kv_heads(h, jnp.float32) for h in (1, 2, 3, 4, 5, 8, 9, 12)] == [
        1, 2, 4, 4, 8, 8, 12, 12,
    ]  # fmt: skip
    assert [pool_kv_heads(h, jnp.bfloat16) for h in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [pool_head_dim(d) for d in (64, 128, 192, 256)] == [128, 128, 256, 256]
    assert combined_pool_shape(10, 16, 3, 64, jnp.float32) == (10, 16, 8, 128)


def test_write_kv_combined_matches_combining_afterwards(rng):
    """Writing rows into the combined pool equals writing them into split pools, then
    combining; negative slots write nothing."""
    nb, bs, hkv, d, t = 6, 4, 3, 64, 9
    k_pages = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    v_pages = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[[2, 5]] = -1
    pool = write_kv_combined(combine_kv(jnp.asarray(k_pages), jnp.asarray(v_pages)), k, v, slots)
    for row, slot in enumerate(slots):
        if slot >= 0:
            k_pages.reshape(nb * bs, hkv, d)[slot] = k[row]
            v_pages.reshape(nb * bs, hkv, d)[slot] = v[row]
    expect = np.asarray(combine_kv(jnp.asarray(k_pages), jnp.asarray(v_pages)))
    np.testing.assert_array_equal(np.asarray(pool), expect)
    # K head h at 2h, V head h at 2h + 1; padding heads and lanes zero
    np.testing.assert_array_equal(expect[:, :, 2, :d], k_pages[:, :, 1])
    np.testing.assert_array_equal(expect[:, :, 5, :d], v_pages[:, :, 2])
    assert not expect[:, :, 6:].any() and not expect[..., d:].any()


def test_tpu_backend_refuses_float16(rng):
    case = make_case(rng, [(1, 5)], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                     dtype=np.float16)  # fmt: skip
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ragged_paged_attention(*map(jnp.asarray, case.args()), sm_scale=0.1, backend="tpu")


def test_engine_on_the_tpu_backend_matches_the_cpu_engine():
    """A tiny model served with attention_backend="tpu" (combined pool, JAX's kernel in TPU
    interpret mode) samples the same greedy tokens as the default CPU engine."""
    import jax

    from jaxpaged.engine import LLMEngine
    from jaxpaged.models.testing import random_params, tiny_config
    from jaxpaged.sampling_params import SamplingParams

    cfg = tiny_config(head_dim=16)
    params = jax.tree.map(jnp.asarray, random_params(cfg))

    def greedy(backend):
        engine = LLMEngine.from_params(
            cfg, params, attention_backend=backend, max_model_len=64, max_num_seqs=2,
            max_num_batched_tokens=16, num_kv_blocks=12, block_size=8, enforce_eager=True,
        )  # fmt: skip
        for i, prompt in enumerate(([1, 5, 9, 2, 7, 11, 3, 4, 8, 20], [3, 4, 5])):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, temperature=0.0))
        tokens = {}
        while len(tokens) < 2 or engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        return engine, tokens

    engine, tokens = greedy("tpu")
    assert engine.layout.combined and len(engine.runner.pool) == 1
    # the platform chose JAX's kernel in TPU interpret mode (a CPU), for the steps to run
    platform = engine.platform
    assert (platform.attention_backend, platform.interpret) == ("tpu", True)
    assert engine.runner._step_kwargs()["interpret"] is True
    assert tokens == greedy(None)[1]
    assert all(len(t) == 4 for t in tokens.values())


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TPU_SWEEP") != "all",
    reason="about 6 minutes on 2 cores (30 layers through the TPU simulator): "
    "JAXPAGED_TPU_SWEEP=all runs it",
)
def test_bundled_model_on_the_tpu_backend_matches_the_cpu_engine(bundled_model_path):
    from jaxpaged import LLM, SamplingParams

    prompts = ["The capital of France is", "def add(a, b):"]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    tokens = {}
    for backend in (None, "tpu"):
        llm = LLM(bundled_model_path, attention_backend=backend, enforce_eager=True,
                  max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
                  num_kv_blocks=24, block_size=16)  # fmt: skip
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["tpu"] == tokens[None]
    assert all(len(t) == 3 for t in tokens[None])


@pytest.mark.parametrize(
    "dtype,d,hq,hkv,bs",
    [("bfloat16", 128, 32, 8, 16), ("float32", 64, 9, 3, 16), ("bfloat16", 256, 8, 1, 32)],
)
def test_tpu_kernel_lowers_for_tpu_on_a_cpu(dtype, d, hq, hkv, bs):
    """JAX's kernel over our padded, combined pool passes the Pallas->Mosaic lowering for a
    TPU (an abstract TPU v5e device; no TPU needed), as the step would call it."""
    import functools

    import jax
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from jaxpaged.kernels.tpu import ragged_paged_attention_tpu

    dt = jnp.dtype(dtype)
    t, s, p, nb = 64, 8, 40, 128
    args = [
        jax.ShapeDtypeStruct((t, hq, d), dt),
        jax.ShapeDtypeStruct(combined_pool_shape(nb, bs, hkv, d, dt), dt),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s, p), jnp.int32),
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    ]
    fn = functools.partial(ragged_paged_attention_tpu, num_kv_heads=hkv, sm_scale=0.1,
                           sliding_window=64, soft_cap=30.0, interpret=False)  # fmt: skip
    device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("device", ["TPU v5", "TPU v6"])
def test_tuned_block_sizes_lookup_on_a_tpu(monkeypatch, device):
    """On a TPU the kernel's blocks come from JAX's tuned table, looked up with the per-block
    head counts the kernel uses (the device is faked: the lookup only reads its name)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    from jaxpaged.kernels.tpu import _block_sizes

    monkeypatch.setattr(tuned_block_sizes, "get_tpu_version", lambda: int(device[-1]))
    monkeypatch.setattr(tuned_block_sizes, "get_device_name", lambda num_devices=None: device)
    q = jnp.zeros((256, 32, 128), jnp.bfloat16)
    kv_pages = jnp.zeros((64, 16, *combined_pool_shape(1, 16, 8, 128, jnp.bfloat16)[2:]))
    kv_pages = kv_pages.astype(jnp.bfloat16)
    pages, tokens = _block_sizes(q, kv_pages, 128, on_tpu=True)
    assert 1 <= pages <= 128 and 1 <= tokens <= 256
    assert (pages, tokens) != (min(128, 64 // 16), 16)  # not the interpret-mode blocks
