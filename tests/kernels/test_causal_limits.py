"""Per-row causal limits (``causal_limits``: the bidirectional span of an image's tokens) in
every CPU backend: the jnp reference against a float64 numpy loop, then "cpu" and "xla"
against the reference on fresh random cases (decode rows, prefill from scratch, chunked
prefill on a cached prefix, padding rows of NaN queries with garbage limits, garbage outside
the sequences), with and without a sliding window; the Pallas GPU kernels in interpret mode;
JAX's TPU kernel refuses them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu, ragged_paged_attention, ragged_paged_attention_reference
from jaxpaged.kernels.testing import (
    make_case,
    mixed_seqs,
    numpy_attention,
    random_spans,
    run_and_compare,
)

# (head_dim, block_size, num_q_heads, num_kv_heads, dtype, sliding_window, soft_cap)
SHAPES = [
    (64, 16, 8, 4, "float32", None, None),  # Gemma 3-like GQA
    (32, 8, 4, 4, "float32", 6, None),  # MHA with a window narrower than some spans
    (64, 16, 8, 2, "bfloat16", 9, 3.0),  # bfloat16 pool, window and soft cap
    (36, 8, 16, 1, "float32", None, None),  # CPU scalar loops: group 16, head_dim % 8 != 0
]


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_numpy(rng, tools, window):
    seqs = [(1, 19), (17, 17), (12, 30), (0, 5), (1, 1), (23, 23)]
    case = make_case(
        rng, seqs, num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=4, max_seqs=8,
        pad_tokens=3,
    )  # fmt: skip
    limits, spans = random_spans(rng, case, case.q.shape[0])
    assert spans, "the case has no span"
    out = ragged_paged_attention_reference(
        *map(jnp.asarray, case.args()),
        sm_scale=case.sm_scale,
        sliding_window=window,
        causal_limits=jnp.asarray(limits),
    )
    expect = numpy_attention(case, sliding_window=window, spans=spans)
    assert tools["rel_err"](out, expect) < 1e-5
    tools["check_padding_rows"](out, case)
    # the spans matter: plain causal attention is far off
    assert tools["rel_err"](numpy_attention(case, sliding_window=window), expect) > 1e-2


NATIVE = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")
# every shape on the native kernel (cheap); the XLA path compiles ~10 s per shape on 2
# busy cores, so it takes two
CASES = [pytest.param("cpu", *shape, marks=NATIVE) for shape in SHAPES] + [
    ("xla", *SHAPES[i]) for i in (1, 2)
]


@pytest.mark.parametrize("backend,d,bs,hq,hkv,dtype,window,cap", CASES)
def test_backend_matches_reference(rng, backend, d, bs, hq, hkv, dtype, window, cap):
    seqs = mixed_seqs(rng, bs, n=7) + [(40, 40), (70, 90)]  # tiles of 32 rows (cpu), 64 (xla)
    run_and_compare(
        rng, seqs, hq=hq, hkv=hkv, d=d, bs=bs, dtype=dtype, backend=backend, max_seqs=11,
        sliding_window=window, soft_cap=cap, causal_limits=True,
    )  # fmt: skip


def test_pallas_interpret_matches_reference(rng):
    """The Pallas GPU kernels in interpret mode: groups of 3 heads padded to 4 matmul rows,
    whose limits must line up; a window narrower than some spans; prefill tiles of 16 rows."""
    seqs = mixed_seqs(rng, 8, n=4) + [(30, 30), (19, 40)]
    run_and_compare(
        rng, seqs, hq=6, hkv=2, d=16, bs=8, dtype="float32", backend="pallas", interpret=True,
        max_seqs=7, sliding_window=7, causal_limits=True,
    )  # fmt: skip


def test_tpu_refuses_limits(rng):
    case = make_case(rng, [(3, 3)], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="backend 'tpu' does not take causal_limits"):
        ragged_paged_attention(
            *map(jnp.asarray, case.args()), sm_scale=1.0, backend="tpu", interpret=True,
            causal_limits=jnp.zeros((3,), jnp.int32),
        )  # fmt: skip


@pytest.mark.parametrize("limits", [np.zeros((4,), np.int32), np.zeros((3,), np.float32)])
def test_bad_limits_are_refused(rng, limits):
    case = make_case(rng, [(3, 3)], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="causal_limits must be int32"):
        ragged_paged_attention(
            *map(jnp.asarray, case.args()), sm_scale=1.0, backend="reference",
            causal_limits=jnp.asarray(limits),
        )  # fmt: skip
