"""The KV pool's layout per attention backend, chosen in this one place.

Most backends read two pools, K and V, each ``[num_blocks, block_size, Hkv, D]``. The "tpu"
backend (JAX's TPU kernel) reads one pool with K and V combined per page and padded to the
kernel's tiling (``tpu.combined_pool_shape``). An 8-bit (int8 / float8_e4m3fn) pool adds a
float32 scale per (token, KV head) for K and for V (kv_quant.py). A :class:`PoolFormat` gives the engine the
pool's array shapes, how to write new K/V rows into it and how to attend over it, so the
step and the model code never branch on the backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .attention import BACKENDS, ragged_paged_attention, refuse_causal_limits
from .write_kv import write_kv, write_kv_quantized

# (k_pages, v_pages), (kv_pages,) when combined, (k_pages, v_pages, k_scales, v_scales) quantized
Pool = tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class PoolFormat:
    combined: bool  # one pool, K and V interleaved per head (JAX's TPU kernel)
    quantized: bool = False  # 8-bit K/V pages plus float32 scales per (token, head)

    def __post_init__(self) -> None:
        if self.combined and self.quantized:
            from .tpu import refuse_quantized

            refuse_quantized(jnp.int8)

    def page_dtypes(self, dtype) -> tuple[jnp.dtype, ...]:
        """Dtype of each array of the pool whose K/V values are ``dtype``."""
        if self.combined:
            return (jnp.dtype(dtype),)
        if self.quantized:
            return (jnp.dtype(dtype),) * 2 + (jnp.dtype(jnp.float32),) * 2
        return (jnp.dtype(dtype),) * 2

    def page_shapes(
        self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype
    ) -> tuple[tuple[int, ...], ...]:
        """Shape of each array of the pool."""
        if self.combined:
            from .tpu import combined_pool_shape

            return (combined_pool_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype),)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if self.quantized:
            return (shape, shape, shape[:3], shape[:3])
        return (shape, shape)

    def write(
        self,
        pool: Pool,
        k: jax.Array,  # [T, Hkv, D]
        v: jax.Array,  # [T, Hkv, D]
        slot_mapping: jax.Array,  # int32 [T]; negative = padding
    ) -> Pool:
        if self.combined:
            from .tpu import write_kv_combined

            return (write_kv_combined(pool[0], k, v, slot_mapping),)
        if self.quantized:
            return write_kv_quantized(pool, k, v, slot_mapping)
        return write_kv(*pool, k, v, slot_mapping)

    def attend(
        self,
        q: jax.Array,  # [T, Hq, D]
        pool: Pool,
        kv_lens: jax.Array,  # int32 [S]
        block_tables: jax.Array,  # int32 [S, P]
        cu_q_lens: jax.Array,  # int32 [S + 1]
        num_seqs: jax.Array,  # int32 [1]
        *,
        num_kv_heads: int,
        sm_scale: float,
        backend: str,
        interpret: bool = False,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        max_q_len: int | None = None,
        max_kv_len: int | None = None,
        alibi_slopes: jax.Array | None = None,  # float32 [Hq]
        causal_limits: jax.Array | None = None,  # int32 [T]
    ) -> jax.Array:  # [T, Hq, D]
        if self.combined:
            from .tpu import ragged_paged_attention_tpu, refuse_alibi

            if alibi_slopes is not None:
                refuse_alibi()
            if causal_limits is not None:
                refuse_causal_limits("tpu")

            return ragged_paged_attention_tpu(
                q, pool[0], kv_lens, block_tables, cu_q_lens, num_seqs,
                num_kv_heads=num_kv_heads, sm_scale=sm_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
            )  # fmt: skip
        scales = dict(k_scales=pool[2], v_scales=pool[3]) if self.quantized else {}
        if alibi_slopes is not None:
            scales["alibi_slopes"] = alibi_slopes
        if causal_limits is not None:
            scales["causal_limits"] = causal_limits
        return ragged_paged_attention(
            q, *pool[:2], kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap,
            backend=backend, interpret=interpret, max_q_len=max_q_len,
            max_kv_len=max_kv_len, **scales,
        )  # fmt: skip


SPLIT = PoolFormat(combined=False)  # separate K and V pools: every backend but "tpu"


def pool_format(backend: str, *, quantized: bool = False) -> PoolFormat:
    """The layout the attention ``backend`` (a name of BACKENDS, resolved: the engine's
    Platform picks it) reads; ``quantized`` for an 8-bit KV cache (a ValueError on "tpu")."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    return PoolFormat(combined=backend == "tpu", quantized=quantized)
