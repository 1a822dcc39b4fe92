"""Writing new K/V rows into the paged pool.

The pool is viewed as a flat array of slots (`slot = block_id * block_size + offset`) and
the new rows are scattered into it. Under `jax.jit(..., donate_argnums=...)` XLA performs
the scatter in place on the donated buffer, so the pool is never copied; negative slots
(padding rows) are redirected past the end of the pool and dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cpu
from .attention import default_backend
from .kv_quant import check_scales, quantize_rows


def _check(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> None:
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"v_pages {v_pages.shape}/{v_pages.dtype} must match k_pages {k_pages.shape}/{k_pages.dtype}"
        )
    row_shape = k_pages.shape[2:]
    if k.ndim != 3 or k.shape[1:] != row_shape:
        raise ValueError(
            f"k must be [num_tokens, {row_shape[0]}, {row_shape[1]}] to fit k_pages, got {k.shape}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v shape {v.shape} must equal k shape {k.shape}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(
            f"slot_mapping must be [num_tokens={k.shape[0]}], got shape {slot_mapping.shape}"
        )
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping must be an integer array, got {slot_mapping.dtype}")
    num_slots = k_pages.shape[0] * k_pages.shape[1]
    if num_slots + k.shape[0] >= 2**31:
        raise ValueError(f"pool of {num_slots} slots is too large for int32 slot ids")


def write_kv(
    k_pages: jax.Array,  # [N, B, Hkv, D]
    v_pages: jax.Array,  # [N, B, Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # int32 [T]; negative = padding, not written
) -> tuple[jax.Array, jax.Array]:  # (k_pages, v_pages), same shapes
    """Return the pools with row t of k/v stored at flat slot `slot_mapping[t]`.

    Slots must be distinct (padding aside); k/v are cast to the pool dtype. Donate the
    pools to the enclosing jit for an in-place update.
    """
    _check(k_pages, v_pages, k, v, slot_mapping)
    shape = k_pages.shape
    num_slots = shape[0] * shape[1]
    num_tokens = k.shape[0]
    slots = slot_mapping.astype(jnp.int32)
    # Each padding row gets its own out-of-bounds index, so the indices stay unique and
    # the scatter can skip conflict handling; mode="drop" discards them.
    slots = jnp.where(slots < 0, num_slots + jnp.arange(num_tokens, dtype=jnp.int32), slots)

    if k_pages.dtype.itemsize in (1, 2) and default_backend() == "cpu":
        # XLA:CPU scatters into a 16-bit float pool by converting all of it to float32 and
        # back (seconds per step for a bfloat16 model); the native copy moves only the rows.
        # 8-bit pools (int8, float8_e4m3fn) take the same copy.
        return cpu.write_kv_native(k_pages, v_pages, k, v, slots)

    def scatter(pages: jax.Array, rows: jax.Array) -> jax.Array:
        flat = pages.reshape(num_slots, *shape[2:])  # [N * B, Hkv, D], a free bitcast
        flat = flat.at[slots].set(rows.astype(pages.dtype), mode="drop", unique_indices=True)
        return flat.reshape(shape)

    return scatter(k_pages, k), scatter(v_pages, v)


def write_kv_quantized(
    pool: tuple[jax.Array, jax.Array, jax.Array, jax.Array],  # k/v pages [N, B, Hkv, D] 8-bit,
    # k/v scales float32 [N, B, Hkv]
    k: jax.Array,  # [T, Hkv, D] float
    v: jax.Array,  # [T, Hkv, D] float
    slot_mapping: jax.Array,  # int32 [T]; negative = padding, not written
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # the pool, same shapes
    """`write_kv` into an 8-bit pool (kv_quant.py): each (token, head) row is quantized with
    its own scale and the rows and their scales are stored at the same slots, in one op."""
    k_pages, v_pages, k_scales, v_scales = pool
    _check(k_pages, v_pages, k, v, slot_mapping)
    check_scales(k_pages, k_scales, v_scales)
    kq, ks = quantize_rows(k, k_pages.dtype)
    vq, vs = quantize_rows(v, v_pages.dtype)
    # the scales as pools of rows of one element, so the same row writer stores them
    scale_shape = (*k_scales.shape, 1)
    k_scales, v_scales = write_kv(
        k_scales.reshape(scale_shape), v_scales.reshape(scale_shape),
        ks[..., None], vs[..., None], slot_mapping,
    )  # fmt: skip
    k_pages, v_pages = write_kv(k_pages, v_pages, kq, vq, slot_mapping)
    return k_pages, v_pages, k_scales.reshape(scale_shape[:3]), v_scales.reshape(scale_shape[:3])
