"""The device KV pool: how many blocks fit, creating it inside jit, and moving blocks.

One pool holds every layer: k and v are each [num_layers * num_blocks, block_size, Hkv, hd],
and layer l's view of block b is row l * num_blocks + b. Keeping one flat array per K and V
lets the step carry (and donate) two buffers instead of 2 * num_layers, and lets the kernels
see the plain [num_blocks, block_size, Hkv, hd] interface with per-layer offset block ids.
With the "tpu" attention backend the pool is one array, K and V combined per page and padded
to the kernel's tiling (``KVLayout.combined``; kernels/pool_format.py has the shapes). An
8-bit KV cache (dtype int8 or float8_e4m3fn) adds k and v scales, each [L * num_blocks,
block_size, Hkv] float32 (kernels/kv_quant.py): block rows line up with the pages', so
copy-on-write and swap move a block's scales with its values.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.kv_quant import KV_QUANT_DTYPES, is_quantized
from jaxpaged.kernels.pool_format import PoolFormat
from jaxpaged.models.config import ModelConfig
from jaxpaged.worker.engine_jit import engine_jit

# (k, v), each [L * num_blocks, block_size, Hkv, hd]; or (kv,) when combined; or
# (k, v, k_scales, v_scales) for an 8-bit pool, scales [L * num_blocks, block_size, Hkv]
KVPool = tuple[jax.Array, ...]

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Shape of the pool; hashable so jitted pool functions can take it statically."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # of the K/V values; int8 / float8_e4m3fn: quantized, with scales
    combined: bool = False  # one array, K and V per page (the "tpu" attention backend)

    @property
    def format(self) -> PoolFormat:
        return PoolFormat(combined=self.combined, quantized=is_quantized(self.dtype))

    @property
    def dtypes(self) -> tuple[jnp.dtype, ...]:
        """Dtype of each array of the pool."""
        return self.format.page_dtypes(self.dtype)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of each array of the pool (rows: num_layers * num_blocks)."""
        return self.format.page_shapes(
            num_blocks=self.num_layers * self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=jnp.dtype(self.dtype),
        )

    @property
    def bytes_per_block(self) -> int:
        """Bytes one logical block takes across all layers, K and V (padding and scales
        included)."""
        return sum(
            self.num_layers * int(np.prod(s[1:])) * np.dtype(d).itemsize
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of the K (and of the V) array of a split pool."""
        return (
            self.num_layers * self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )


def block_bytes(
    *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str
) -> int:
    """Bytes of one block of a split pool, all layers, K and V (and an 8-bit pool's scales)."""
    return KVLayout(
        num_layers=num_layers, num_blocks=1, block_size=block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
    ).bytes_per_block  # fmt: skip


def kv_storage_dtype(kv_cache_dtype: str, model_kv_dtype: str) -> str:
    """The pool's value dtype for ``--kv-cache-dtype``: "auto" keeps the model's, "fp8" is
    float8_e4m3fn, "int8" int8 (both quantized, kernels/kv_quant.py), else the name itself."""
    if kv_cache_dtype == "auto":
        return model_kv_dtype
    return KV_QUANT_DTYPES.get(kv_cache_dtype, kv_cache_dtype)


def num_blocks_for(
    model: ModelConfig,
    *,
    block_size: int,
    dtype: str,
    max_model_len: int,
    num_kv_blocks: int | None,
    kv_cache_memory: int | None,
    available_bytes: int | None = None,
    combined: bool = False,
) -> int:
    """Decides the pool size: an explicit count, else a byte budget; fails early when one
    sequence of max_model_len would not fit, naming the figures and the flags to change."""
    per_block = KVLayout(
        num_layers=model.num_layers,
        num_blocks=1,
        block_size=block_size,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=dtype,
        combined=combined,
    ).bytes_per_block
    if num_kv_blocks is not None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        blocks = num_kv_blocks
        source = f"num_kv_blocks={num_kv_blocks}"
    else:
        budget = kv_cache_memory if kv_cache_memory is not None else available_bytes
        if budget is None:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        blocks = int(budget // per_block)
        source = f"{budget / 2**30:.2f} GiB of KV cache memory"
    needed = -(-max_model_len // block_size)
    if blocks < needed:
        raise ValueError(
            f"the KV cache ({source}: {blocks} blocks of {block_size} tokens, "
            f"{per_block} bytes each) cannot hold one sequence of max_model_len={max_model_len}, "
            f"which needs {needed} blocks = {needed * per_block / 2**30:.3f} GiB; raise "
            "kv_cache_memory (--kv-cache-memory) or gpu_memory_utilization "
            "(--gpu-memory-utilization), set num_kv_blocks, or lower max_model_len (--max-model-len)"
        )
    return blocks


# Kept free beside the pool and the largest step's planned scratch: the step's outputs, the
# sampler state, block-move and swap buffers, and XLA/cuBLAS workspaces outside the plan.
KV_SAFETY_MARGIN_FRACTION = 0.02
KV_SAFETY_MARGIN_MIN = 256 << 20


def device_kv_budget(
    *, gpu_memory_utilization: float, activation_bytes: int, device: jax.Device | None = None
) -> int | None:
    """Bytes the KV pool may take on an accelerator: ``gpu_memory_utilization`` of the device's
    memory, less what is in use (weights), the step's scratch memory and a safety margin
    (2% of the device, at least 256 MiB). None on CPU, where the budget is
    ``kv_cache_memory`` instead; a ValueError on an accelerator whose allocator reports no
    limit, rather than a guessed size.

    JAX's allocator limit (``bytes_limit``) is ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device
    (0.75 unless set), so the device total is recovered from it.
    """
    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ValueError(
            f"the {device.platform} allocator reports no memory limit, so gpu_memory_utilization "
            "cannot size the KV cache; set kv_cache_memory (--kv-cache-memory) or num_kv_blocks"
        )
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    total = limit / fraction
    in_use = stats.get("bytes_in_use", 0)
    margin = max(KV_SAFETY_MARGIN_MIN, int(KV_SAFETY_MARGIN_FRACTION * total))
    budget = min(gpu_memory_utilization * total, limit) - in_use - activation_bytes - margin
    return max(0, int(budget))


def configure_device_memory(gpu_memory_utilization: float) -> None:
    """Before JAX starts: no preallocation, and an allocator limit of the utilization, so the
    KV pool (not JAX's own arena) gets the memory. No effect once a backend is up."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{gpu_memory_utilization:.3f}")


@functools.partial(engine_jit, static_argnames=("layout", "sharding"))
def create_pool(*, layout: KVLayout, sharding: jax.sharding.Sharding | None = None) -> KVPool:
    """Born on the device (and with its sharding), never staged through the host."""
    pool = []
    for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
        zeros = jnp.zeros(shape, dtype)
        if sharding is not None:
            zeros = jax.lax.with_sharding_constraint(zeros, sharding)
        pool.append(zeros)
    return tuple(pool)


def layer_rows(block_ids: jax.Array, *, num_layers: int, num_blocks: int) -> jax.Array:
    """Pool rows of the given logical blocks in every layer: [N] -> [L, N]."""
    return block_ids[None, :] + num_blocks * jnp.arange(num_layers, dtype=block_ids.dtype)[:, None]


@functools.partial(engine_jit, static_argnames=("num_layers", "num_blocks"), donate_argnums=(0,))
def copy_blocks(
    pool: KVPool,
    src: jax.Array,  # [N] int32 logical block ids; padding entries are -1
    dst: jax.Array,  # [N] int32
    *,
    num_layers: int,
    num_blocks: int,
) -> KVPool:
    """Copy-on-write: dst := src in every layer. Padding pairs (-1) write nothing."""
    valid = (src >= 0)[None, :]
    src_rows = layer_rows(jnp.maximum(src, 0), num_layers=num_layers, num_blocks=num_blocks)
    dst_rows = layer_rows(dst, num_layers=num_layers, num_blocks=num_blocks)
    dst_rows = jnp.where(valid, dst_rows, num_layers * num_blocks)  # out of range: dropped
    return tuple(p.at[dst_rows].set(p[src_rows], mode="drop") for p in pool)


@functools.partial(engine_jit, static_argnames=("num_layers", "num_blocks"))
def gather_blocks(
    pool: KVPool,
    block_ids: jax.Array,  # [N] int32; padding entries are -1 (gathers block 0, ignored)
    *,
    num_layers: int,
    num_blocks: int,
) -> tuple[jax.Array, jax.Array]:
    """Reads blocks for swap-out: one [L, N, *page] array per pool array."""
    rows = layer_rows(jnp.maximum(block_ids, 0), num_layers=num_layers, num_blocks=num_blocks)
    return tuple(p[rows] for p in pool)


@functools.partial(engine_jit, static_argnames=("num_layers", "num_blocks"), donate_argnums=(0,))
def scatter_blocks(
    pool: KVPool,
    block_ids: jax.Array,  # [N] int32; padding entries are -1 (not written)
    data: tuple[jax.Array, ...],  # one [L, N, *page] array per pool array
    *,
    num_layers: int,
    num_blocks: int,
) -> KVPool:
    """Writes swapped-in blocks back, bit-exactly."""
    rows = layer_rows(block_ids, num_layers=num_layers, num_blocks=num_blocks)
    rows = jnp.where((block_ids >= 0)[None, :], rows, num_layers * num_blocks)
    return tuple(p.at[rows].set(d, mode="drop") for p, d in zip(pool, data, strict=True))
