"""The TPU backend: JAX's own ragged paged-attention kernel
(``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) behind jaxpaged's interface.

That kernel reads one pool with K and V combined per page: ``[num_blocks, block_size,
2 * Hkv, D]``, K head h at index 2h and V head h at 2h + 1, so one DMA brings both. Mosaic
tiles the combined-head axis and the lane axis, so the pool is padded where the model's
shapes do not tile: the KV heads up to a count the kernel accepts (``pool_kv_heads``: 3 ->
4 for SmolLM2) and head_dim up to a multiple of 128 lanes (``pool_head_dim``: 64 -> 128).
Padded KV heads and lanes hold zeros and are read by zero query heads and lanes, so they
change no logit; the cost is pool memory (2.7x for SmolLM2, none for 8 KV heads of 128).

Off a TPU the kernel runs in Pallas' TPU interpret mode (``tpu_interpret.py``), which is how
the CPU test suite checks it against the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa

LANES = 128  # a TPU vector register's minor dimension


def _packing(dtype) -> int:
    """Values of this dtype per 32-bit word (Mosaic packs 16-bit values in pairs)."""
    return max(1, 4 // jnp.dtype(dtype).itemsize)


def _tiles(num_combined_heads: int, dtype) -> bool:
    """Whether the kernel accepts this many combined K/V heads (its own tiling rule)."""
    packing = _packing(dtype)
    if num_combined_heads % packing:
        return False
    words = num_combined_heads // packing
    return words in (1, 2, 4, 8) or words % 8 == 0


def refuse_alibi(model_type: str | None = None) -> None:
    """ValueError for ALiBi biases: JAX's TPU ragged paged attention kernel takes no bias
    input (only sm_scale, sliding_window, soft_cap and static k/v scales)."""
    model = f"model_type {model_type!r} uses" if model_type else "ALiBi needs"
    raise ValueError(
        f"{model} ALiBi attention biases, which the 'tpu' attention backend (JAX's TPU "
        "ragged paged attention kernel) does not take; use attention_backend='xla' "
        "(--attention-backend xla)"
    )


def refuse_quantized(dtype) -> None:
    """ValueError for an 8-bit pool: JAX 0.10.2's TPU kernel takes only static per-tensor
    ``k_scale``/``v_scale`` floats, not the per-(token, head) scales written with each row
    (kv_quant.py), so an int8/fp8 KV cache cannot be read on this backend."""
    if jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)):
        raise ValueError(
            f"the 'tpu' attention backend cannot read a {jnp.dtype(dtype)} KV cache: JAX's TPU "
            "ragged paged attention takes one static scale per tensor, not the per-(token, "
            "head) scales of jaxpaged's quantized pools; use kv_cache_dtype='auto' or "
            "'bfloat16' (--kv-cache-dtype), or attention_backend='xla' (--attention-backend)"
        )


def pool_kv_heads(num_kv_heads: int, dtype) -> int:
    """KV heads per page in the combined pool: the fewest >= num_kv_heads the kernel tiles."""
    heads = num_kv_heads
    while not _tiles(2 * heads, dtype):
        heads += 1
    return heads


def pool_head_dim(head_dim: int) -> int:
    """head_dim rounded up to whole 128-lane vectors."""
    return -(-head_dim // LANES) * LANES


def combined_pool_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype
) -> tuple[int, int, int, int]:
    return (
        num_blocks,
        block_size,
        2 * pool_kv_heads(num_kv_heads, dtype),
        pool_head_dim(head_dim),
    )


def _combined_rows(
    k: jax.Array,  # [..., Hkv, D]
    v: jax.Array,  # [..., Hkv, D]
    kv_heads: int,
    head_dim: int,
) -> jax.Array:  # [..., 2 * kv_heads, head_dim]: K, V interleaved per head, zero padded
    kv = jnp.stack([k, v], axis=-2)  # [..., Hkv, 2, D]
    pad = [(0, 0)] * (kv.ndim - 3)
    pad += [(0, kv_heads - k.shape[-2]), (0, 0), (0, head_dim - k.shape[-1])]
    kv = jnp.pad(kv, pad)
    return kv.reshape(*kv.shape[:-3], 2 * kv_heads, head_dim)


def combine_kv(
    k_pages: jax.Array,  # [NB, B, Hkv, D]
    v_pages: jax.Array,  # [NB, B, Hkv, D]
) -> jax.Array:  # [NB, B, 2 * pool_kv_heads, pool_head_dim]
    """Separate K and V pools as one combined pool (a copy: for tests and the split-pool entry;
    the engine keeps its pool combined)."""
    heads = pool_kv_heads(k_pages.shape[2], k_pages.dtype)
    return _combined_rows(k_pages, v_pages, heads, pool_head_dim(k_pages.shape[3]))


def write_kv_combined(
    kv_pages: jax.Array,  # [N, B, 2 * Hp, Dp]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # int32 [T]; negative = padding, not written
) -> jax.Array:  # [N, B, 2 * Hp, Dp]
    """Stores row t of k and v at flat slot ``slot_mapping[t]`` of the combined pool, in one
    scatter (in place when the pool is donated)."""
    num_blocks, block_size, combined, head_dim = kv_pages.shape
    if k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [num_tokens, Hkv, D], got {k.shape} and {v.shape}")
    if 2 * k.shape[1] > combined or k.shape[2] > head_dim:
        raise ValueError(f"k/v rows {k.shape[1:]} do not fit the combined pool {kv_pages.shape}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {slot_mapping.shape}")
    num_slots = num_blocks * block_size
    rows = _combined_rows(k, v, combined // 2, head_dim).astype(kv_pages.dtype)
    slots = slot_mapping.astype(jnp.int32)
    # each padding row its own out-of-range index: unique indices, dropped by mode="drop"
    slots = jnp.where(slots < 0, num_slots + jnp.arange(k.shape[0], dtype=jnp.int32), slots)
    flat = kv_pages.reshape(num_slots, combined, head_dim)
    flat = flat.at[slots].set(rows, mode="drop", unique_indices=True)
    return flat.reshape(kv_pages.shape)


def _block_sizes(q, kv_pages, pages_per_seq: int, on_tpu: bool) -> tuple[int, int]:
    """(KV pages, query tokens) per kernel block: JAX's tuned table on a TPU (looked up as the
    kernel itself would); small blocks elsewhere (interpret mode, where every grid step costs
    host work, and lowering tests)."""
    if on_tpu:
        q_heads_per_blk, combined_per_blk = jax_rpa.kernel.get_min_heads_per_blk(
            q.shape[1], kv_pages.shape[2], q.dtype, kv_pages.dtype
        )
        return jax_rpa.get_tuned_block_sizes(
            q.dtype, kv_pages.dtype, q_heads_per_blk, combined_per_blk // 2,
            q.shape[2], kv_pages.shape[1], q.shape[0], pages_per_seq,
        )  # fmt: skip
    return min(pages_per_seq, max(1, 64 // kv_pages.shape[1])), min(q.shape[0], 16)


@functools.partial(
    jax.jit,
    static_argnames=("num_kv_heads", "sm_scale", "sliding_window", "soft_cap", "interpret"),
)
def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [NB, B, 2 * Hp, Dp] combined pool (combined_pool_shape)
    kv_lens: jax.Array,  # int32 [S]
    block_tables: jax.Array,  # int32 [S, P]
    cu_q_lens: jax.Array,  # int32 [S + 1]
    num_seqs: jax.Array,  # int32 scalar or [1]
    *,
    num_kv_heads: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # [T, Hq, D]
    """See ``jaxpaged.kernels.ragged_paged_attention``; the pool is combined and padded, and
    ``num_kv_heads`` is the model's (unpadded) count. ``interpret`` (default: when not on a
    TPU) runs the kernel in Pallas' TPU interpret mode."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, combined, lanes = kv_pages.shape
    if num_q_heads % num_kv_heads or 2 * num_kv_heads > combined or head_dim > lanes:
        raise ValueError(
            f"q {q.shape} with {num_kv_heads} KV heads does not fit the combined pool "
            f"{kv_pages.shape}"
        )
    if kv_pages.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(
            f"the tpu backend (JAX's TPU kernel) takes float32 or bfloat16 pools, got {kv_pages.dtype}"
        )
    max_seqs, pages_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    heads = combined // 2
    on_tpu = jax.default_backend() == "tpu"
    interpret = (not on_tpu) if interpret is None else interpret

    # Inputs in the shape the kernel wants: padding rows zero (the interface allows NaN there),
    # metadata past num_seqs and table entries past a sequence's blocks made harmless.
    num_seqs = jnp.reshape(num_seqs, (1,)).astype(jnp.int32)
    total = cu_q_lens[num_seqs[0]]
    seq_valid = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs[0]
    kv_lens = jnp.where(seq_valid, kv_lens, 0)
    cu_q_lens = jnp.where(jnp.arange(max_seqs + 1) <= num_seqs[0], cu_q_lens, total)
    n_pages = -(-kv_lens // block_size)
    tables = jnp.where(jnp.arange(pages_per_seq)[None, :] < n_pages[:, None], block_tables, 0)
    row_ok = jnp.arange(num_tokens, dtype=jnp.int32) < total
    qk = jnp.where(row_ok[:, None, None], q, 0).astype(kv_pages.dtype)
    qk = qk.reshape(num_tokens, num_kv_heads, group, head_dim)
    qk = jnp.pad(qk, ((0, 0), (0, heads - num_kv_heads), (0, 0), (0, lanes - head_dim)))
    qk = qk.reshape(num_tokens, heads * group, lanes)

    kv_per_blk, q_per_blk = _block_sizes(qk, kv_pages, pages_per_seq, on_tpu)
    padded_tokens = -(-num_tokens // q_per_blk) * q_per_blk
    qk = jnp.pad(qk, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))

    call = functools.partial(
        jax_rpa.ragged_paged_attention,
        qk,
        kv_pages,
        kv_lens,
        tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_kv_pages_per_block=kv_per_blk,
        num_queries_per_block=q_per_blk,
    )
    if interpret:
        from .tpu_interpret import interpret_mode

        with interpret_mode():
            out = call()
    else:
        out = call()
    out = out[:num_tokens].reshape(num_tokens, heads, group, lanes)
    out = out[:, :num_kv_heads, :, :head_dim].reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(row_ok[:, None, None], out, 0).astype(q.dtype)
