"""The "xla" backend against the jnp reference on fresh random ragged batches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.kernels import ragged_paged_attention
from jaxpaged.kernels.testing import DTYPES, TOLERANCE, make_case
from jaxpaged.kernels.xla import ragged_paged_attention_xla


def mixed_seqs(rng, block_size, n=6):
    """Decode rows, prefill from scratch, chunked prefill on a cached prefix."""
    seqs = []
    for i in range(n):
        kind = i % 3
        kv = int(rng.integers(1, 5 * block_size))
        if kind == 0:  # decode
            seqs.append((1, kv))
        elif kind == 1:  # prefill from scratch
            seqs.append((kv, kv))
        else:  # chunked prefill on top of a cached prefix
            seqs.append((int(rng.integers(1, kv + 1)), kv))
    rng.shuffle(seqs)
    return [tuple(s) for s in seqs]


def run_and_compare(rng, tools, seqs, *, hq, hkv, d, bs, dtype, max_seqs=None, pad=3, **kw):
    case = make_case(
        rng,
        seqs,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=DTYPES[dtype],
        max_seqs=max_seqs,
        pad_tokens=pad,
    )
    args = tuple(map(jnp.asarray, case.args()))
    opts = dict(
        sm_scale=case.sm_scale,
        sliding_window=kw.pop("sliding_window", None),
        soft_cap=kw.pop("soft_cap", None),
    )
    ref = ragged_paged_attention(*args, **opts, backend="reference")
    out = kw.pop("fn", None)
    if out is None:
        out = ragged_paged_attention(*args, **opts, backend="xla", **kw)
    else:
        out = out(*args, **opts, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = tools["rel_err"](out, ref)
    assert err < TOLERANCE[dtype], f"rel err {err} for {seqs}"
    tools["check_padding_rows"](out, case)
    return case


# (head_dim, block_size, num_q_heads, num_kv_heads, dtype, sliding_window, soft_cap): each
# value of every axis appears, without the full product.
SWEEP = [
    (64, 16, 9, 3, "float32", None, None),  # SmolLM2
    (64, 8, 4, 4, "float32", 7, None),  # MHA
    (128, 32, 8, 1, "float32", None, None),  # MQA, ratio 8
    (64, 64, 4, 2, "bfloat16", None, 3.0),
    (128, 16, 8, 2, "bfloat16", None, None),
    (64, 32, 8, 2, "float16", 20, 5.0),
    (256, 8, 2, 1, "float32", None, None),
]


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
