"""Clear ValueErrors naming the argument for inconsistent inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import default_backend, ragged_paged_attention
from jaxpaged.kernels.testing import make_case


@pytest.fixture
def args(rng):
    case = make_case(
        rng, [(1, 9), (4, 4)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, max_seqs=3
    )
    return [jnp.asarray(a) for a in case.args()]


def call(args, **kw):
    kw.setdefault("sm_scale", 0.25)
    kw.setdefault("backend", "reference")
    return ragged_paged_attention(*args, **kw)


@pytest.mark.parametrize(
    "index,bad,match",
    [
        (0, lambda a: a[:, :, :8], "head_dim"),
        (0, lambda a: a[:, :3], "multiple of num_kv_heads"),
        (0, lambda a: a[0], "q must be"),
        (0, lambda a: a.astype(jnp.int32), "q dtype"),
        (2, lambda a: a[:, :2], "v_pages shape"),
        (2, lambda a: a.astype(jnp.bfloat16), "v_pages dtype"),
        (3, lambda a: a[:2], "block_tables must be"),
        (3, lambda a: a.astype(jnp.float32), "kv_lens must be int32"),
        (4, lambda a: a[:, None], "block_tables must be"),
        (5, lambda a: a[:3], "cu_q_lens"),
        (6, lambda a: jnp.zeros((2,), jnp.int32), "num_seqs"),
    ],
)
def test_bad_inputs_raise(args, index, bad, match):
    args = list(args)
    args[index] = bad(args[index])
    with pytest.raises(ValueError, match=match):
        call(args)


def test_bad_options_raise(args):
    with pytest.raises(ValueError, match="backend"):
        call(args, backend="cuda")
    with pytest.raises(ValueError, match="sm_scale"):
        call(args, sm_scale=0.0)
    with pytest.raises(ValueError, match="sliding_window"):
        call(args, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        call(args, soft_cap=-1.0)


def test_default_backend():
    assert default_backend("cpu") in ("cpu", "xla")  # "cpu" when the native kernel builds
    assert default_backend("gpu") == "pallas"
    assert default_backend("tpu") == "tpu"  # JAX's own TPU kernel (kernels/tpu.py)


def test_scalar_num_seqs_accepted(args):
    out_vec = call(args)
    out_scalar = call(args[:6] + [args[6][0]])
    np.testing.assert_array_equal(np.asarray(out_vec), np.asarray(out_scalar))
