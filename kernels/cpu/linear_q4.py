"""The native matmul over group-wise quantized weights (cpu_linear_q4.cc): 4-bit values two
per byte with float32 scales and mins per group of inputs, or 8-bit values with scales.

A weight arrives as the model's ``GroupedWeight`` (``values`` uint8 [L, N, K/2] or int8
[L, N, K], ``scales`` and ``mins`` float32 [L, N, K/G], ``bits``); kernels import nothing of
ours, so it is read through those attributes. It needs no repacking: the kernel reads the
format's own layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _LINEAR_Q4_TARGET, _fused_operands, _require
from .features import cpu_flags

__all__ = ["is_grouped_weight", "linear_q4", "x_rounding"]

CHUNK = 16  # inputs the kernel unpacks at once: a group size must be a multiple
LANES_ROWS = (6, 32)  # with AVX512-VNNI, real rows whose x is rounded to int16 (lanes path)
CHUNK_ROWS = 4  # AVX2 without AVX-512: up to this many real rows round x per chunk
X_CHUNK = 32  # inputs per scale of x there; the group size must be a multiple
CHUNK_LEVELS = 254 * 127  # x's largest integer there: two int8 parts, 254 hi + lo


def x_rounding(rows: int, group: int, bits: int, flags: frozenset[str] | None = None) -> str | None:
    """How a step of ``rows`` real rows over ``bits``-bit weights of ``group``-input groups
    has its x rounded in the kernel on a CPU with ``flags`` (default: this one's), as the
    kernel built with -march=native chooses: "chunk" (one scale per ``X_CHUNK`` inputs, max
    |x| / ``CHUNK_LEVELS``: 4-bit weights on AVX2 without AVX-512, up to ``CHUNK_ROWS`` rows;
    cpu_linear_q4_i8.h), "row" (int16, one scale per row, max |x| / 32767: one row with
    AVX-512, up to two otherwise), "group" (int16, one per group of inputs: with AVX512-VNNI,
    ``LANES_ROWS``, decode steps; cpu_linear_q4_lanes.h) or None (float32)."""
    flags = cpu_flags() if flags is None else flags
    avx512 = {"avx512f", "avx512bw"} <= flags
    if "avx2" not in flags or "fma" not in flags:
        return None
    if not avx512 and bits == 4 and rows <= CHUNK_ROWS and group % X_CHUNK == 0:
        return "chunk"
    if rows <= (1 if avx512 else 2):
        return "row"
    lanes = LANES_ROWS[0] <= rows <= LANES_ROWS[1]
    return "group" if avx512 and {"avx512_vnni", "avx512vl"} <= flags and lanes else None


def is_grouped_weight(w: Any) -> bool:
    """Whether ``w`` is a group-wise quantized weight the kernel reads (any group size that
    is a multiple of 16; consecutive groups, not act-order's ``g_idx``)."""
    group = getattr(w, "group_size", None)
    consecutive = getattr(w, "g_idx", None) is None
    return group is not None and hasattr(w, "scales") and group % CHUNK == 0 and consecutive


def linear_q4(
    x: jax.Array,  # float32 or bfloat16 [M, K]
    w: Any,  # values [L, N, K/2] uint8 or [L, N, K] int8, scales (and mins) [L, N, K/G]
    layer: jax.Array | int,  # int32 []
    *,
    num_rows: jax.Array | int | None = None,  # int32 []: rows of x that are real (default M)
    out_dtype: jnp.dtype | None = None,  # default: x's dtype
    residual: jax.Array | None = None,  # [M, N]
    norm: tuple[jax.Array, float] | None = None,  # (weight [K], eps)
    silu_gate: jax.Array | None = None,  # [M, K]
) -> jax.Array:  # residual + norm(silu(silu_gate) * x) @ dequantize(w[layer]).T  [M, N]
    """`cpu.linear`'s contract over a group-wise quantized weight: each group's products
    summed, times its scale, plus its min times the sum of x over the group. In float32,
    except where ``x_rounding`` says x is rounded to integers so the products run in integer
    multiply-adds: 4-bit decode steps on AVX2 without AVX-512 (per 32 inputs, as two int8 parts:
    vpmaddubsw, 32 weights an instruction), one real row otherwise (int16 per row, as
    linear_q8), and with AVX512-VNNI 6 to 32 rows (int16 per group, vpdpwssd)."""
    _require("kernels")
    values, scales, mins, bits = w.values, w.scales, w.mins, w.bits
    k = x.shape[-1]
    if x.ndim != 2 or values.ndim != 3 or values.shape[2] * (2 if bits == 4 else 1) != k:
        raise ValueError(
            f"linear_q4 needs x [M, K] and a weight [L, N, K], got {x.shape} and {w.shape}"
        )
    if not is_grouped_weight(w):
        raise ValueError(f"linear_q4 needs a group size that is a multiple of {CHUNK}")
    out = jax.ShapeDtypeStruct((x.shape[0], values.shape[1]), jnp.float32)
    none = jnp.zeros((0,), jnp.float32)
    y = jax.ffi.ffi_call(_LINEAR_Q4_TARGET, out)(
        x.astype(jnp.float32),
        values,
        scales.astype(jnp.float32),
        none if mins is None else mins.astype(jnp.float32),
        *_fused_operands(x, out, layer, num_rows, residual, norm, silu_gate),
        norm_eps=np.float32(0.0 if norm is None else norm[1]),
        bits=np.int64(bits),
    )
    return y.astype(out_dtype or x.dtype)
