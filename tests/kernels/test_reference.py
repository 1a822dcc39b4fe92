"""The jnp reference against an independent float64 numpy loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import ragged_paged_attention_reference
from jaxpaged.kernels.testing import make_case, numpy_attention


@pytest.mark.parametrize(
    "sliding_window,soft_cap", [(None, None), (6, None), (None, 2.5), (3, 4.0)]
)
def test_reference_matches_numpy(rng, tools, sliding_window, soft_cap):
    seqs = [(1, 19), (9, 9), (6, 23), (0, 5), (1, 1), (13, 13)]
    case = make_case(
        rng,
        seqs,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        max_seqs=9,
        pad_tokens=4,
    )
    out = ragged_paged_attention_reference(
        *map(jnp.asarray, case.args()),
        sm_scale=case.sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    expect = numpy_attention(case, sliding_window=sliding_window, soft_cap=soft_cap)
    assert tools["rel_err"](out, expect) < 1e-5
    tools["check_padding_rows"](out, case)
    assert np.isfinite(np.asarray(out)).all()
