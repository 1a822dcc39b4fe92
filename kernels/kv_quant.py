"""Quantized KV pools: int8 or float8_e4m3fn K/V with one float32 scale per (token, KV head).

Why per (token, head): the scale of a row is decided when the row is written, from that row
alone, so writing stays a scatter of new rows (a per-block or per-head scale would have to
be fixed before the block's later tokens are seen, or rescale the rows already stored), and
one outlier token only coarsens its own row. The cost is 4 bytes per (token, head) beside
``head_dim`` bytes of values: 6% at head_dim 64, so an 8-bit pool holds 1.88x the tokens of a
bfloat16 pool and 3.76x those of a float32 pool (the scales could be 16-bit for 1.94x; float32
keeps every backend's dequantization one multiply with no range concerns).

A quantized pool is ``(k_pages, v_pages, k_scales, v_scales)``: pages ``[N, B, Hkv, D]`` in
the 8-bit dtype and scales ``[N, B, Hkv]`` float32, so the scales of block ``n`` are row ``n``
of the scale arrays and anything that moves whole blocks (copy-on-write, swap) moves them too.
Row value = stored value * scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The 8-bit storage dtypes and the largest magnitude each stores: a row's amax maps to it.
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
# --kv-cache-dtype names of the quantized pools
KV_QUANT_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}


def is_quantized(dtype) -> bool:
    """True for the 8-bit pool dtypes (int8, float8_e4m3fn), which need scales."""
    return jnp.dtype(dtype) in QMAX


def quantize_rows(
    x: jax.Array,  # [T, Hkv, D] float
    dtype,  # int8 or float8_e4m3fn
) -> tuple[jax.Array, jax.Array]:  # ([T, Hkv, D] dtype, float32 [T, Hkv])
    """Symmetric quantization of each (token, head) row to ``dtype`` with its own scale
    amax / qmax (int8 rounds to nearest; fp8 rounds in the cast). A zero row gets scale 0."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax  # [T, Hkv]
    y = x / jnp.where(scale > 0, scale, 1.0)[..., None]
    if dtype == jnp.dtype(jnp.int8):
        y = jnp.clip(jnp.round(y), -qmax, qmax)
    else:
        y = jnp.clip(y, -qmax, qmax)
    return y.astype(dtype), scale


def dequantize(
    pages: jax.Array,  # [..., Hkv, D] int8 / float8_e4m3fn
    scales: jax.Array,  # float32 [..., Hkv]
    dtype=jnp.float32,
) -> jax.Array:  # [..., Hkv, D] dtype
    return (pages.astype(jnp.float32) * scales[..., None]).astype(dtype)


def check_scales(
    k_pages: jax.Array,  # [N, B, Hkv, D]
    k_scales: jax.Array | None,  # float32 [N, B, Hkv]
    v_scales: jax.Array | None,  # float32 [N, B, Hkv]
) -> None:
    """ValueError unless scales come exactly with an 8-bit pool, shaped [N, B, Hkv] float32."""
    quantized = is_quantized(k_pages.dtype)
    given = (k_scales is not None, v_scales is not None)
    if given[0] != given[1]:
        raise ValueError("k_scales and v_scales must be given together")
    if quantized and not given[0]:
        raise ValueError(
            f"a {k_pages.dtype} KV pool needs k_scales and v_scales [num_blocks, block_size, "
            "num_kv_heads] float32"
        )
    if not quantized and given[0]:
        raise ValueError(
            f"k_scales/v_scales go with an int8 or float8_e4m3fn pool, not {k_pages.dtype}"
        )
    if quantized:
        want = k_pages.shape[:3]
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s.shape != want or s.dtype != jnp.float32:
                raise ValueError(
                    f"{name} must be float32 {want} (one scale per token and KV head), "
                    f"got {s.dtype} {s.shape}"
                )
