"""The XLA path of a quantized weight's matmul.

Per-channel (`QuantizedWeight`): the values converted to x's dtype inside the dot (XLA fuses
the convert into the dot's operand read) and the per-output scale applied to the [T, N]
product, where it costs T * N multiplies instead of N * K.

Group-wise (`GroupedWeight`): the one [N, K] matrix this call reads is dequantized to x's
dtype, then dotted (one layer at a time under the decoder's scan, never the whole model). On
XLA:CPU that beat per-group partial dots (an einsum over [T, K/G, G] x [N, K/G, G] followed by
the scales and mins) by 3x at T = 1 and 4x at T = 256 (SmolLM2's 1536 x 576 gate, 2 cores),
because the partial products are T * N * K/G floats written and read back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .grouped import GroupedWeight
from .weights import QuantizedWeight

__all__ = ["QUANTIZED_WEIGHTS", "embedding_rows", "matmul", "quantized_matmul", "vocab_logits"]

QUANTIZED_WEIGHTS = (QuantizedWeight, GroupedWeight)  # what quantized_matmul takes


def quantized_matmul(
    x: jax.Array,  # [T, K]
    w: QuantizedWeight | GroupedWeight,  # [N, K] (values [N, K], scales [N, 1] or grouped)
) -> jax.Array:  # x @ dequantize(w).T  [T, N], x's dtype
    """x @ dequantize(w).T; a per-channel scale is moved past the contraction (exact: it is
    per output)."""
    if w.ndim != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"quantized_matmul needs w [N, K] with K = {x.shape[-1]}, got {w.shape}")
    if isinstance(w, GroupedWeight):
        return jnp.einsum("ti,oi->to", x, w.dequantize(x.dtype))
    y = jnp.einsum("ti,oi->to", x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w.scales[:, 0].astype(jnp.float32)).astype(x.dtype)


def matmul(
    x: jax.Array,  # [T, K]
    w: jax.Array | QuantizedWeight | GroupedWeight,  # [N, K]
) -> jax.Array:  # [T, N], x's dtype
    """x @ w.T over a float weight or a quantized one (dequantized in the dot)."""
    if isinstance(w, QUANTIZED_WEIGHTS):
        return quantized_matmul(x, w)
    return jnp.einsum("ti,oi->to", x, w)


def vocab_logits(
    hidden: jax.Array,  # [T, D]
    w: jax.Array | QuantizedWeight | GroupedWeight,  # [V, D]: lm_head or the tied table
) -> jax.Array:  # float32 [T, V]
    """Vocabulary logits in float32 over a float or quantized vocabulary projection."""
    if isinstance(w, QUANTIZED_WEIGHTS):
        return quantized_matmul(hidden, w).astype(jnp.float32)
    return jnp.einsum("td,vd->tv", hidden, w, preferred_element_type=jnp.float32)


def embedding_rows(
    table: jax.Array | GroupedWeight,  # [V, D]
    tokens: jax.Array,  # int32 [T]
) -> jax.Array:  # [T, D]
    """The embedding rows of ``tokens``; a quantized table (a GGUF model's tied embedding)
    dequantizes only those rows, in float32."""
    if isinstance(table, GroupedWeight):
        mins = None if table.mins is None else jnp.take(table.mins, tokens, axis=0)
        rows = GroupedWeight(
            jnp.take(table.values, tokens, axis=0),
            jnp.take(table.scales, tokens, axis=0),
            mins,
            (tokens.shape[0], table.shape[-1]),
            table.group_size,
            table.bits,
        )
        return rows.dequantize(jnp.float32)
    return jnp.take(jnp.asarray(table), tokens, axis=0)
