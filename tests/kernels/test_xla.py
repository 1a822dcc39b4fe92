"""The "xla" backend against the jnp reference on fresh random ragged batches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.kernels import ragged_paged_attention
from jaxpaged.kernels.testing import SWEEP, mixed_seqs
from jaxpaged.kernels.testing import run_and_compare as _run_and_compare
from jaxpaged.kernels.xla import ragged_paged_attention_xla


def run_and_compare(rng, tools, seqs, **kw):
    kw.setdefault("backend", "xla")
    return _run_and_compare(rng, seqs, **kw)


@pytest.mark.parametrize("d,bs,hq,hkv,dtype,window,cap", SWEEP)
def test_xla_mixed_batch(rng, tools, d, bs, hq, hkv, dtype, window, cap):
    seqs = mixed_seqs(rng, bs)
    run_and_compare(
        rng,
        tools,
        seqs,
        hq=hq,
        hkv=hkv,
        d=d,
        bs=bs,
        dtype=dtype,
        max_seqs=8,
        sliding_window=window,
        soft_cap=cap,
    )


def test_xla_decode_only_hints(rng, tools):
    seqs = [(1, int(rng.integers(1, 90))) for _ in range(7)]
    run_and_compare(
        rng,
        tools,
        seqs,
        hq=9,
        hkv=3,
        d=64,
        bs=16,
        dtype="float32",
        max_seqs=8,
        max_q_len=1,
        max_kv_len=96,
    )


def test_xla_prefill_hint(rng, tools):
    seqs = [(1, 40), (23, 23), (1, 7), (12, 50)]
    run_and_compare(
        rng,
        tools,
        seqs,
        hq=4,
        hkv=2,
        d=64,
        bs=8,
        dtype="float32",
        max_seqs=6,
        max_q_len=24,
        max_kv_len=64,
    )


def test_xla_many_kv_chunks(rng, tools):
    """Small chunks and tiles force the KV loop and many prefill tiles."""
    seqs = [(1, 300), (70, 70), (45, 260), (1, 5)]
    run_and_compare(
        rng,
        tools,
        seqs,
        hq=4,
        hkv=1,
        d=64,
        bs=8,
        dtype="float32",
        max_seqs=5,
        fn=ragged_paged_attention_xla,
        q_tile=8,
        kv_chunk=32,
        sliding_window=37,
    )


def test_xla_long_context(rng, tools):
    """A 32k-token sequence decoding and a chunk prefilling on top of a long prefix."""
    seqs = [(1, 32768), (8, 20000)]
    run_and_compare(rng, tools, seqs, hq=2, hkv=1, d=64, bs=64, dtype="float32", pad=0)


def test_xla_no_padding_and_single_token(rng, tools):
    run_and_compare(rng, tools, [(1, 1)], hq=2, hkv=1, d=64, bs=8, dtype="float32", pad=0)
    run_and_compare(rng, tools, [(5, 5)], hq=2, hkv=2, d=64, bs=8, dtype="float32", pad=0)


def test_xla_never_copies_the_pool(rng):
    """Only the blocks in the tables are gathered: temporaries stay far below the pool size."""
    nb, bs, hkv, d = 4096, 16, 3, 64
    pool_bytes = nb * bs * hkv * d * 4
    pool = jax.ShapeDtypeStruct((nb, bs, hkv, d), jnp.float32)
    args = (
        jax.ShapeDtypeStruct((40, 9, d), jnp.float32), pool, pool,
        jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((8, 64), jnp.int32),
        jax.ShapeDtypeStruct((9,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
    )  # fmt: skip
    fn = functools.partial(ragged_paged_attention, sm_scale=0.125, backend="xla")
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert stats.temp_size_in_bytes < pool_bytes // 20
