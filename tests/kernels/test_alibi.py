"""ALiBi (BLOOM's attention biases) in every backend: the jnp reference against a float64
numpy loop, then each backend against the reference on fresh random cases (decode rows,
prefill from scratch, chunked prefill on a cached prefix, padding rows, garbage outside the
sequences), head counts that are and are not powers of two."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu, ragged_paged_attention, ragged_paged_attention_reference
from jaxpaged.kernels.testing import make_case, mixed_seqs, numpy_attention, run_and_compare
from jaxpaged.models.layers import alibi_slopes

# (head_dim, block_size, num_q_heads, num_kv_heads, dtype, sliding_window, soft_cap)
SHAPES = [
    (16, 4, 6, 6, "float32", None, None),  # BLOOM-like MHA, 6 heads (not a power of two)
    (64, 16, 12, 3, "float32", None, None),  # GQA 4, 12 heads
    (32, 8, 5, 5, "float32", 9, None),  # 5 heads, with a window
    (64, 16, 16, 16, "bfloat16", None, 3.0),  # 16 heads, soft cap, bfloat16
    (36, 8, 16, 1, "float32", None, None),  # CPU scalar loops: group 16, head_dim % 8 != 0
]


def _slopes(hq: int, rng: np.random.Generator) -> np.ndarray:
    """BLOOM's slopes, times a random factor so that the biases dominate some rows."""
    return (alibi_slopes(hq) * rng.uniform(0.5, 4.0)).astype(np.float32)


@pytest.mark.parametrize("hq,hkv,window", [(6, 6, None), (12, 4, 5)])
def test_reference_matches_numpy(rng, tools, hq, hkv, window):
    seqs = [(1, 19), (9, 9), (6, 23), (0, 5), (1, 1), (13, 13)]
    case = make_case(
        rng, seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=16, block_size=4, max_seqs=8,
        pad_tokens=3,
    )  # fmt: skip
    slopes = _slopes(hq, rng)
    out = ragged_paged_attention_reference(
        *map(jnp.asarray, case.args()),
        sm_scale=case.sm_scale,
        sliding_window=window,
        alibi_slopes=jnp.asarray(slopes),
    )
    expect = numpy_attention(case, sliding_window=window, alibi_slopes=slopes)
    assert tools["rel_err"](out, expect) < 1e-5
    tools["check_padding_rows"](out, case)
    # the biases matter: without them the result is far off
    plain = numpy_attention(case, sliding_window=window)
    assert tools["rel_err"](plain, expect) > 1e-2


NATIVE = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")
# every shape on the native kernel (cheap to run); the XLA path compiles ~10 s per shape on
# 2 busy cores, so it takes two (MHA in float32; GQA 16:16 in bfloat16 with a soft cap)
CASES = [pytest.param("cpu", *shape, marks=NATIVE) for shape in SHAPES] + [
    ("xla", *SHAPES[i]) for i in (0, 3)
]


@pytest.mark.parametrize("backend,d,bs,hq,hkv,dtype,window,cap", CASES)
def test_backend_matches_reference(rng, backend, d, bs, hq, hkv, dtype, window, cap):
    run_and_compare(
        rng, mixed_seqs(rng, bs, n=7), hq=hq, hkv=hkv, d=d, bs=bs, dtype=dtype,
        backend=backend, max_seqs=9, sliding_window=window, soft_cap=cap,
        alibi_slopes=_slopes(hq, rng),
    )  # fmt: skip


@NATIVE
def test_decode_only_step(rng):
    """A whole decode step with long contexts: the native kernel's decode chains (each item
    prefetching the next one's first blocks)."""
    seqs = [(1, int(rng.integers(1, 200))) for _ in range(12)]
    run_and_compare(
        rng, seqs, hq=6, hkv=6, d=16, bs=16, dtype="float32", backend="cpu",
        max_q_len=1, alibi_slopes=_slopes(6, rng),
    )  # fmt: skip


def test_pallas_interpret_matches_reference(rng):
    """The Pallas GPU kernels in interpret mode (decode and prefill kernels): 12 heads in
    groups of 3, each group padded to 4 matmul rows whose slopes must line up."""
    run_and_compare(
        rng, mixed_seqs(rng, 8, n=5), hq=12, hkv=4, d=16, bs=8, dtype="float32",
        backend="pallas", interpret=True, max_seqs=6, alibi_slopes=_slopes(12, rng),
    )  # fmt: skip


def test_tpu_backend_refuses_alibi(rng):
    case = make_case(rng, [(3, 3)], num_q_heads=4, num_kv_heads=4, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="ALiBi.*'tpu'"):
        ragged_paged_attention(
            *map(jnp.asarray, case.args()), sm_scale=case.sm_scale, backend="tpu",
            alibi_slopes=jnp.ones((4,), jnp.float32),
        )  # fmt: skip


@pytest.mark.parametrize("slopes", [np.ones(3, np.float32), np.ones(4, np.int32)])
def test_bad_slopes_are_refused(rng, slopes):
    case = make_case(rng, [(3, 3)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="alibi_slopes must be float32"):
        ragged_paged_attention(
            *map(jnp.asarray, case.args()), sm_scale=case.sm_scale, backend="xla",
            alibi_slopes=jnp.asarray(slopes),
        )  # fmt: skip


@NATIVE
def test_cpu_quantized_pool_with_alibi(rng, tools):
    """An int8 KV cache and ALiBi together on the native kernel (both ride in one call):
    against the reference over the same pool dequantized."""
    from jaxpaged.kernels.kv_quant import dequantize, quantize_rows

    seqs = mixed_seqs(rng, 8, n=6)
    case = make_case(
        rng, seqs, num_q_heads=6, num_kv_heads=6, head_dim=16, block_size=8, max_seqs=7,
        pad_tokens=3,
    )  # fmt: skip
    nb, bs, hkv, d = case.k_pages.shape
    (kq, ks), (vq, vs) = (
        quantize_rows(jnp.asarray(p).reshape(nb * bs, hkv, d), jnp.int8)
        for p in (case.k_pages, case.v_pages)
    )
    pools = [x.reshape(nb, bs, hkv, *x.shape[2:]) for x in (kq, vq, ks, vs)]
    meta = tuple(map(jnp.asarray, case.args()[3:]))
    slopes = jnp.asarray(_slopes(6, rng))
    opts = dict(sm_scale=case.sm_scale, alibi_slopes=slopes)
    floats = (dequantize(pools[0], pools[2]), dequantize(pools[1], pools[3]))
    q = jnp.asarray(case.q)
    ref = ragged_paged_attention(q, *floats, *meta, **opts, backend="reference")
    out = ragged_paged_attention(
        q, *pools[:2], *meta, **opts, k_scales=pools[2], v_scales=pools[3], backend="cpu"
    )
    total = sum(ql for ql, _ in seqs)
    assert tools["rel_err"](np.asarray(out)[:total], np.asarray(ref)[:total]) < 1e-5
    tools["check_padding_rows"](out, case)
