"""The Pallas kernels in interpret mode against the reference, and their Triton lowering.

Interpret mode fills every output buffer with NaN before the kernel runs, so rows the
kernels fail to write show up. Shapes are small: interpret mode is slow on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import ragged_paged_attention
from jaxpaged.kernels.pallas_gpu import PallasConfig, ragged_paged_attention_pallas
from jaxpaged.kernels.testing import DTYPES, make_case, run_and_compare


def mixed_seqs(rng, block_size):
    """Decode rows, a prefill from scratch, chunked prefill on a cached prefix."""
    seqs = [
        (1, int(rng.integers(1, 4 * block_size))),
        (int(rng.integers(2, 3 * block_size)), 0),
        (1, int(rng.integers(1, 3 * block_size))),
        (int(rng.integers(2, 20)), int(rng.integers(20, 3 * block_size + 20))),
    ]
    seqs[1] = (seqs[1][0], seqs[1][0])
    order = rng.permutation(len(seqs))
    return [seqs[i] for i in order]


CASES = [
    # head_dim, block_size, Hq, Hkv, dtype, sliding_window, soft_cap, config
    (64, 16, 9, 3, "float32", None, None, PallasConfig()),
    (128, 8, 8, 2, "bfloat16", None, None, PallasConfig(num_splits=2, block_kv=16)),
    (64, 32, 8, 1, "float16", None, None, PallasConfig(prefill_rows=16)),
    (64, 64, 2, 2, "float32", 19, 5.0, PallasConfig()),
]


@pytest.mark.parametrize("d,bs,hq,hkv,dtype,window,cap,config", CASES)
def test_pallas_interpret_matches_reference(rng, d, bs, hq, hkv, dtype, window, cap, config):
    pallas = functools.partial(ragged_paged_attention_pallas, interpret=True, config=config)
    run_and_compare(
        rng, mixed_seqs(rng, bs), hq=hq, hkv=hkv, d=d, bs=bs, dtype=dtype, backend="pallas",
        max_seqs=6, pad=3, sliding_window=window, soft_cap=cap, fn=pallas,
    )  # fmt: skip


def test_pallas_decode_only_through_public_entry(rng, tools):
    """backend=None with interpret=True picks the Pallas kernel; max_q_len=1 skips prefill."""
    seqs = [(1, int(rng.integers(1, 70))) for _ in range(5)]
    case = make_case(
        rng,
        seqs,
        num_q_heads=4,
        num_kv_heads=4,
        head_dim=256,
        block_size=8,
        max_seqs=6,
        pad_tokens=2,
    )
    args = tuple(map(jnp.asarray, case.args()))
    ref = ragged_paged_attention(*args, sm_scale=case.sm_scale, backend="reference")
    out = ragged_paged_attention(*args, sm_scale=case.sm_scale, interpret=True, max_q_len=1)
    assert tools["rel_err"](out, ref) < 1e-5
    tools["check_padding_rows"](out, case)


def _lower_for_gpu(fn, *args):
    """Lower for CUDA on a machine without a GPU (JAX 0.11 needs an abstract device)."""
    traced = jax.jit(fn).trace(*args)
    try:
        return traced.lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
        if "No supported GPU devices" not in str(e):
            raise
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _largest_block(d: int, itemsize: int) -> int:
    from jaxpaged.kernels.pallas_gpu import unsupported_reason

    sizes = [bs for bs in (16, 32, 64, 128, 256) if unsupported_reason(
        head_dim=d, itemsize=itemsize, block_size=bs, group_pad=8) is None]  # fmt: skip
    return max(sizes)


# Every row of choose_config's table (head_dim x dtype size) in every pool dtype, at the
# default block and the largest block the shared-memory budget admits, with GQA and MQA
# groups, and SmolLM2 at block 8; odd sizes elsewhere (50 tokens, 7 sequences, 33 columns).
LOWERING_CASES = [
    (dtype, d, bs, hq, hkv)
    for dtype, itemsize in (("bfloat16", 2), ("float16", 2), ("float32", 4))
    for d, (hq, hkv) in ((64, (9, 3)), (128, (32, 8)), (256, (8, 1)))
    for bs in sorted({16, _largest_block(d, itemsize)})
] + [("float32", 64, 8, 9, 3)]


@pytest.mark.parametrize("dtype,d,bs,hq,hkv", LOWERING_CASES)
def test_pallas_lowers_to_triton(dtype, d, bs, hq, hkv):
    """Both kernels (and the decode-only program) pass the Pallas->Triton lowering (tensor
    sizes, ops) on a CPU machine, for each tile configuration the engine can reach."""
    dt = jnp.dtype(DTYPES[dtype])
    t, nb, s, p = 50, 250, 7, 33
    args = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in [
            ((t, hq, d), dt),
            ((nb, bs, hkv, d), dt),
            ((nb, bs, hkv, d), dt),
            ((s,), jnp.int32),
            ((s, p), jnp.int32),
            ((s + 1,), jnp.int32),
            ((1,), jnp.int32),
        ]
    ]
    for max_q_len, kernels in ((None, 2), (1, 1)):
        fn = functools.partial(
            ragged_paged_attention_pallas, sm_scale=0.1, sliding_window=100, soft_cap=30.0,
            max_q_len=max_q_len,
        )  # fmt: skip
        text = _lower_for_gpu(fn, *args)
        assert text.count("triton") >= kernels, "expected the Triton kernels in the module"
        assert "mosaic" not in text


@pytest.mark.parametrize(
    "dtype,d,bs,hq,hkv", [("bfloat16", 64, 16, 9, 3), ("float32", 128, 16, 16, 16)]
)
def test_pallas_lowers_to_triton_with_alibi(dtype, d, bs, hq, hkv):
    """With ALiBi slopes (one more input per kernel: a row of slopes per KV head) both
    kernels still pass the Triton lowering; 9 heads in groups of 3 pad each group to 4 rows."""
    dt = jnp.dtype(DTYPES[dtype])
    t, nb, s, p = 50, 250, 7, 33
    args = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in [
            ((t, hq, d), dt),
            ((nb, bs, hkv, d), dt),
            ((nb, bs, hkv, d), dt),
            ((s,), jnp.int32),
            ((s, p), jnp.int32),
            ((s + 1,), jnp.int32),
            ((1,), jnp.int32),
            ((hq,), jnp.float32),
        ]
    ]

    def fn(*a):
        return ragged_paged_attention_pallas(*a[:7], sm_scale=0.1, alibi_slopes=a[7])

    text = _lower_for_gpu(fn, *args)
    assert text.count("triton") >= 2, "expected the Triton kernels in the module"


def test_pallas_rejects_non_power_of_two_head_dim(rng):
    case = make_case(rng, [(1, 5)], num_q_heads=2, num_kv_heads=1, head_dim=48, block_size=8)
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention_pallas(*map(jnp.asarray, case.args()), sm_scale=0.1, interpret=True)
    assert np.isfinite(case.q).all()


def test_pallas_interpret_long_context(rng, tools):
    """A 32k-token decode (split over many programs) and a chunk on a 20k prefix."""
    seqs = [(1, 32768), (4, 20000)]
    case = make_case(rng, seqs, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=64)
    args = tuple(map(jnp.asarray, case.args()))
    ref = ragged_paged_attention(*args, sm_scale=case.sm_scale, backend="reference")
    out = ragged_paged_attention_pallas(
        *args, sm_scale=case.sm_scale, interpret=True, config=PallasConfig(block_kv=256)
    )
    assert tools["rel_err"](out, ref) < 1e-5


def test_pallas_gpu_tiles_fit_shared_memory():
    """Every shape the engine can hand the kernels (head_dim 16..256, 16/32-bit pools, block
    sizes 1..256, GQA groups up to 32) either gets tiles within the shared-memory budget or
    is reported unsupported (the engine then uses XLA); the common ones are supported."""
    from jaxpaged.kernels.pallas_gpu import (
        SMEM_BUDGET,
        choose_config,
        smem_bytes,
        unsupported_reason,
    )

    supported = set()
    for d in (16, 32, 64, 128, 256):
        for itemsize in (2, 4):
            for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                for g in (1, 2, 4, 8, 16, 32):
                    dims = dict(head_dim=d, itemsize=itemsize, block_size=bs, group_pad=g)
                    config = choose_config(**dims)
                    need = smem_bytes(config, **dims)
                    if unsupported_reason(**dims) is None:
                        assert max(need.values()) <= SMEM_BUDGET, (dims, config, need)
                        assert config.num_stages >= 1 and config.prefill_rows >= 16
                        supported.add((d, itemsize, bs))
                    else:
                        assert max(need.values()) > SMEM_BUDGET
    for d in (64, 128, 256):
        for itemsize in (2, 4):
            for bs in (8, 16, 32):
                assert (d, itemsize, bs) in supported
    assert "head_dim" in unsupported_reason(head_dim=96, itemsize=2, block_size=16, group_pad=4)
    # the table: deeper decode pipelining and more prefill warps for a 128-wide bf16 head
    c = choose_config(head_dim=128, itemsize=2, block_size=16, group_pad=4)
    assert (c.block_kv, c.num_stages, c.prefill_warps) == (64, 3, 8)


def test_default_pallas_falls_back_to_xla_with_one_warning(rng, tools, monkeypatch, caplog):
    """Where Pallas is the platform default (GPUs) a shape it cannot run (head_dim 48) is
    served by the XLA path, with a warning naming the cause, instead of failing."""
    from jaxpaged.kernels import attention

    monkeypatch.setattr(attention, "default_backend", lambda platform=None: "pallas")
    case = make_case(rng, [(1, 5), (3, 9)], num_q_heads=4, num_kv_heads=2, head_dim=48,
                     block_size=8, max_seqs=3, pad_tokens=2)  # fmt: skip
    args = tuple(map(jnp.asarray, case.args()))
    with caplog.at_level("WARNING", logger=attention.__name__):
        out = ragged_paged_attention(*args, sm_scale=case.sm_scale)
    ref = ragged_paged_attention(*args, sm_scale=case.sm_scale, backend="reference")
    assert tools["rel_err"](out, ref) < 1e-5
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "head_dim must be a power of two" in warnings[0]


def test_decode_splits_follow_the_real_longest_context():
    """With an engine-wide table (512 blocks) and contexts of at most 32 blocks, the splits
    share the 32 blocks (none takes all of them), not the table's width."""
    from jaxpaged.kernels.pallas_gpu import _split_pages, _split_range

    splits, step = 8, 4
    most = 512 // splits
    share = int(_split_pages(jnp.int32(32), splits, step, most))
    assert share == 4
    first, end = _split_range(jnp.arange(splits), share, jnp.int32(32 * 16), None, 16)
    assert np.all(np.asarray(end - first) == 4)  # every split reads 4 of the 32 blocks
    assert int(_split_pages(jnp.int32(1), splits, step, most)) == step
    assert int(_split_pages(jnp.int32(4000), splits, step, most)) == most


def test_pallas_interpret_short_contexts_in_a_wide_table(rng, tools):
    """Engine-like decode: a table of 64 blocks per sequence, contexts of 1-40 tokens; the
    splits that get no blocks write nothing (interpret mode leaves their outputs NaN) and
    the merge leaves them out."""
    seqs = [(1, int(rng.integers(1, 40))) for _ in range(5)]
    case = make_case(rng, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     max_seqs=6, pad_tokens=2, extra_table_cols=60)  # fmt: skip
    assert case.block_tables.shape[1] >= 60
    args = tuple(map(jnp.asarray, case.args()))
    ref = ragged_paged_attention(*args, sm_scale=case.sm_scale, backend="reference")
    out = ragged_paged_attention_pallas(
        *args, sm_scale=case.sm_scale, interpret=True, max_q_len=1,
        config=PallasConfig(num_splits=8, block_kv=16),
    )  # fmt: skip
    assert tools["rel_err"](out, ref) < 1e-5
    tools["check_padding_rows"](out, case)
