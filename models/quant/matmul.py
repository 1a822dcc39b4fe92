"""The XLA path of a quantized weight's matmul: the values converted to x's dtype inside the
dot (XLA fuses the convert into the dot's operand read) and the per-output scale applied to
the [T, N] product, where it costs T * N multiplies instead of N * K."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .weights import QuantizedWeight

__all__ = ["quantized_matmul"]


def quantized_matmul(
    x: jax.Array,  # [T, K]
    w: QuantizedWeight,  # values [N, K], scales [N, 1]
) -> jax.Array:  # x @ (values * scales).T  [T, N], x's dtype
    """x @ dequantize(w).T with the scale moved past the contraction (exact: it is per
    output)."""
    if w.ndim != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"quantized_matmul needs w [N, K] with K = {x.shape[-1]}, got {w.shape}")
    y = jnp.einsum("ti,oi->to", x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w.scales[:, 0].astype(jnp.float32)).astype(x.dtype)
