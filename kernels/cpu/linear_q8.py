"""The native matmul over int8 weights with per-output scales (cpu_linear_q8.cc).

A quantized weight arrives as the model's ``QuantizedWeight`` (``values`` int8 [L, N, K],
``scales`` float32 [L, N, 1]); kernels import nothing of ours, so it is read through those
two attributes and rebuilt with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _LINEAR_Q8_TARGET, PANEL, _fused_operands, _require

__all__ = ["is_int8_weight", "linear_q8", "pack_panels_q8", "unpack_panels_q8"]


def is_int8_weight(w: Any) -> bool:
    """Whether ``w`` is a quantized weight with int8 values and one scale per output (the
    kernel's input; a group-wise weight, which has a ``group_size``, is not)."""
    values = getattr(w, "values", None)
    per_output = hasattr(w, "scales") and not hasattr(w, "group_size")
    return per_output and values is not None and values.dtype == jnp.int8


def pack_panels_q8(w: Any) -> Any:  # values [..., N, K] -> [..., N, K], q8 panel layout
    """The kernel's layout of an int8 [out, in] weight: each [N, K] matrix stored as
    [N/16, K/2, 16, 2], so one k pair of a panel's 16 outputs is 32 contiguous bytes
    (cpu_linear_q8.cc). The scales keep their layout."""
    v = w.values
    *lead, n, k = v.shape
    if n % PANEL or k % 2:
        raise ValueError(f"pack_panels_q8 needs N % {PANEL} == 0 and K even, got {tuple(v.shape)}")
    panels = jnp.reshape(v, (*lead, n // PANEL, PANEL, k // 2, 2))
    packed = jnp.swapaxes(panels, -3, -2).reshape(v.shape)
    return dataclasses.replace(w, values=packed)


def unpack_panels_q8(w: Any) -> Any:
    """The inverse of `pack_panels_q8`."""
    v = w.values
    *lead, n, k = v.shape
    panels = jnp.reshape(v, (*lead, n // PANEL, k // 2, PANEL, 2))
    return dataclasses.replace(w, values=jnp.swapaxes(panels, -3, -2).reshape(v.shape))


def linear_q8(
    x: jax.Array,  # float32 or bfloat16 [M, K]
    w: Any,  # values int8 [L, N, K] in q8 panel layout, scales float32 [L, N, 1]
    layer: jax.Array | int,  # int32 []
    *,
    num_rows: jax.Array | int | None = None,  # int32 []: rows of x that are real (default M)
    out_dtype: jnp.dtype | None = None,  # default: x's dtype
    residual: jax.Array | None = None,  # [M, N]
    norm: tuple[jax.Array, float] | None = None,  # (weight [K], eps)
    silu_gate: jax.Array | None = None,  # [M, K]
) -> jax.Array:  # residual + norm(silu(silu_gate) * x) @ (values * scales)[layer].T  [M, N]
    """`cpu.linear`'s contract over an int8 weight from `pack_panels_q8`. With one or two
    real rows (decode at batch 1-2) each row of x is rounded to int16 with its own scale (max
    |x| / 32767) inside the kernel and the int8 x int16 products are summed in int32
    (vpmaddwd); from three rows on, the weights are widened to float32 in L1 and multiplied
    in FMAs over x as it is (vpmaddwd does no more multiply-accumulates per cycle than FMA on
    AVX2 EPYCs: 0.84-1.09x of FMA's, measured from L1 on every core)."""
    _require("kernels")
    values, scales = w.values, w.scales
    if x.ndim != 2 or values.ndim != 3 or x.shape[1] != values.shape[2]:
        raise ValueError(f"linear_q8 needs x [M, K] and w [L, N, K], got {x.shape}, {values.shape}")
    if values.shape[1] % PANEL or values.shape[2] % 2 or values.dtype != jnp.int8:
        raise ValueError(f"linear_q8 needs int8 w with N % {PANEL} == 0 and K even")
    out = jax.ShapeDtypeStruct((x.shape[0], values.shape[1]), jnp.float32)
    y = jax.ffi.ffi_call(_LINEAR_Q8_TARGET, out)(
        x.astype(jnp.float32),
        values,
        scales.astype(jnp.float32),
        *_fused_operands(x, out, layer, num_rows, residual, norm, silu_gate),
        norm_eps=np.float32(0.0 if norm is None else norm[1]),
    )
    return y.astype(out_dtype or x.dtype)
