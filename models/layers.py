"""Building blocks of the model families: RMSNorm, LayerNorm, rotary embeddings, attention, biased
dense layers and the stacked per-layer params every family scans over.

Every function is pure jnp so it traces inside `lax.scan` and jit. Numerics follow
Hugging Face transformers: norms, rotary angles and softmax run in float32, matmuls in the
params dtype with float32 accumulation.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .types import TP_AXIS


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; normalise in float32, scale in the input dtype (as HF)."""
    # x: [..., N], weight: [N]
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * normed


def layer_norm(
    x: jax.Array,  # [..., D]
    weight: jax.Array,  # [D]
    bias: jax.Array,  # [D]
    eps: float,
) -> jax.Array:
    """LayerNorm over the last axis in float32, as torch's nn.LayerNorm."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def apply_rope(
    x: jax.Array,  # [T, H, hd]
    positions: jax.Array,  # int32 [T], or [T, hd // 2]: each rotary pair's own (M-RoPE)
    inv_freq: np.ndarray | jax.Array,  # [hd // 2], or [T, hd // 2]: each position's own
    attention_factor: float = 1.0,
) -> jax.Array:
    """Rotate pairs (i, i + hd/2) of every head by position * inv_freq (HF 'rotate_half'
    layout); cos and sin are scaled by ``attention_factor`` (YaRN's), as transformers does."""
    inv_freq = jnp.asarray(inv_freq)
    per_row = inv_freq if inv_freq.ndim == 2 else inv_freq[None, :]
    pos = positions.astype(jnp.float32)
    angles = (pos if pos.ndim == 2 else pos[:, None]) * per_row  # [T, hd/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, hd/2]
    sin = jnp.sin(angles)[:, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:  # float32 [num_heads]
    """ALiBi's per-head slopes (Press et al.), as transformers' BLOOM computes them: a
    geometric sequence from 2^(-8/n) for the n = 2^floor(log2 H) heads, then for a head count
    that is not a power of two, every other term of the sequence for 2n heads."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base**p for p in range(1, closest + 1)]
    if closest != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        rest = min(closest, num_heads - closest)
        slopes += [extra**p for p in range(1, 2 * rest, 2)]
    return np.asarray(slopes, dtype=np.float32)


def grouped_attention(
    q: jax.Array,  # [T, Hq, hd]
    k: jax.Array,  # [S, Hkv, hd]
    v: jax.Array,  # [S, Hkv, hd]
    mask: jax.Array,  # bool [T, S], True where query t may read key s
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    bias: jax.Array | None = None,  # float32 [Hq, T, S], added to the logits after the cap
) -> jax.Array:
    """Masked softmax attention with GQA (query head h reads KV head h // G); logits are
    ``sm_scale * q.k`` (default hd**-0.5), soft-capped as ``soft_cap * tanh(x / soft_cap)``
    if set; returns [T, Hq, hd]."""
    t, hq, hd = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.reshape(t, hkv, g, hd)
    scores = jnp.einsum("tkgh,skh->kgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd) if sm_scale is None else sm_scale)
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    if bias is not None:
        scores = scores + bias.reshape(hkv, g, t, -1)
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A fully masked row (padding) gives NaN; make it zero so outputs stay finite.
    probs = jnp.where(mask.any(axis=-1)[None, None, :, None], probs, 0.0).astype(v.dtype)
    out = jnp.einsum("kgts,skh->tkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(t, hq, hd).astype(q.dtype)


def dense_causal_attention(
    q: jax.Array,  # [T, Hq, hd]
    k: jax.Array,  # [T, Hkv, hd]
    v: jax.Array,  # [T, Hkv, hd]
    layer: jax.Array | int,  # int32 [], unused
    cache: Any,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: jax.Array | np.ndarray | None = None,  # float32 [Hq]
) -> tuple[jax.Array, Any]:
    """The `AttentionFn` of a dense forward: causal attention over the T tokens of one
    sequence (the last ``sliding_window`` positions only, if set), with the paged engine's
    options (ALiBi: ``slopes[h] * (key_pos - query_pos)`` added to head h's logits); ignores
    and returns ``cache`` as is."""
    del layer
    t = q.shape[0]
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    bias = None
    if alibi_slopes is not None:
        rel = (pos[None, :] - pos[:, None]).astype(jnp.float32)  # [T, T] key - query
        bias = jnp.asarray(alibi_slopes, jnp.float32)[:, None, None] * rel
    out = grouped_attention(q, k, v, mask, sm_scale=sm_scale, soft_cap=soft_cap, bias=bias)
    return out, cache


def dense(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """A biased linear layer in the [out, in] weight layout of the stacked params."""
    # x [T, K], w [N, K], b [N] -> [T, N]
    return jnp.einsum("ti,oi->to", x, w) + b


def param(value: Any, split: int | None = None) -> nnx.Param:
    """An nnx.Param whose partition metadata names the axis tensor parallelism splits
    (``split``; None: replicated), as nnx.with_partitioning would: the source of the
    params' shardings (``nnx.get_partition_spec``, distributed/parallel.py). Nothing is
    sharded when it is made (``eager_sharding=False``): the loader places the weights."""
    if split is None:
        return nnx.Param(value)
    names = tuple(TP_AXIS if axis == split else None for axis in range(len(value.shape)))
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class StackedParams(nnx.Module):
    """A family's per-layer leaves, each one nnx.Param stacked over layers [L, ...], so the
    decoder is one ``lax.scan`` and a native matmul reads layer l of a weight in place.
    ``ones``: the leaves that start at one (norm scales); the rest start at zero.
    ``splits``: leaf -> the axis tensor parallelism splits (`param`; absent: replicated)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        dtype: Any,
        *,
        ones: Collection[str] = (),
        splits: Mapping[str, int] | None = None,
    ) -> None:
        splits = splits or {}
        for name, shape in shapes.items():
            init = jnp.ones if name in ones else jnp.zeros
            setattr(self, name, param(init(shape, dtype), splits.get(name)))

    def arrays(self) -> dict[str, jax.Array]:
        """Every stacked leaf by name as device arrays (host arrays cannot take the scan's
        traced index); a quantized weight keeps its type, its arrays made device arrays."""
        return {
            k: jax.tree.map(jnp.asarray, v.get_value())
            for k, v in vars(self).items()
            if isinstance(v, nnx.Variable)
        }
