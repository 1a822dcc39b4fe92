"""Which matmul kernel each step program uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu
from jaxpaged.models.llama import linear_xla
from jaxpaged.step import NATIVE_LINEAR_MAX_ROWS, _linear_fn

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernels")


def params(dtype):
    return {"embed": jnp.zeros((8, 4), dtype)}


def test_decode_sized_float32_steps_use_the_native_matmul():
    assert _linear_fn(params(jnp.float32), 1, None, None) is cpu.linear
    assert _linear_fn(params(jnp.float32), NATIVE_LINEAR_MAX_ROWS, "cpu", None) is cpu.linear


def test_other_steps_use_xla():
    f32 = params(jnp.float32)
    assert _linear_fn(f32, NATIVE_LINEAR_MAX_ROWS + 1, None, None) is linear_xla  # prefill
    assert _linear_fn(params(jnp.bfloat16), 8, None, None) is linear_xla
    assert _linear_fn(f32, 8, "xla", None) is linear_xla  # kernels forced to XLA
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    assert _linear_fn(f32, 8, None, mesh) is linear_xla  # sharded weights: XLA's SPMD dots
