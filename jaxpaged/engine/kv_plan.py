"""The KV pool an engine gets: its storage dtype, its layout for the platform's attention
backend, and how many blocks of it fit. Kept apart from the engine's wiring because each
answer depends on the others (the layout changes the bytes per block, the device's memory the
number of blocks)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.kernels.platform import Platform
from jaxpaged.models.config import ModelConfig
from jaxpaged.worker.kv_cache import KVLayout, device_kv_budget, num_blocks_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVPlan:
    """What the pool stores (``dtype``: kv_storage_dtype of the settings) and in which layout
    (the ``platform``'s pool format, for its attention backend)."""

    model_config: ModelConfig
    block_size: int
    dtype: Any  # the pool's storage dtype
    platform: Platform

    @property
    def combined(self) -> bool:
        """K and V in one padded pool (kernels/pool_format.py)."""
        return self.platform.pool_format.combined

    def layout(self, num_blocks: int) -> KVLayout:
        c = self.model_config
        return KVLayout(
            num_layers=c.num_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=self.dtype,
            combined=self.combined,
        )

    def num_blocks(
        self,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        *,
        activation_bytes: Callable[[KVLayout], int],
        num_devices: int,
    ) -> int:
        """Blocks for the pool: as configured, or what the device's memory holds after the
        largest step's scratch (``activation_bytes`` of a runner over a one-sequence pool);
        on CPU without a setting, num_blocks_for's default."""
        max_len = scheduler_config.max_model_len
        available = None
        if cache_config.num_kv_blocks is None and cache_config.kv_cache_memory is None:
            if self.platform.sizes_kv_from_device_memory:
                available = device_kv_budget(
                    gpu_memory_utilization=cache_config.gpu_memory_utilization,
                    activation_bytes=activation_bytes(self.layout(-(-max_len // self.block_size))),
                )
                if available is not None:
                    available *= num_devices  # the pool is split over the mesh
                if available is not None and jax.process_count() > 1:
                    from jaxpaged.distributed.multihost import agree_min_bytes

                    available = agree_min_bytes(available)  # every host: the same pool
        num_blocks = num_blocks_for(
            self.model_config,
            block_size=self.block_size,
            dtype=self.dtype,
            max_model_len=max_len,
            num_kv_blocks=cache_config.num_kv_blocks,
            kv_cache_memory=cache_config.kv_cache_memory,
            available_bytes=available,
            combined=self.combined,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.3f GiB), %d tokens, %.1f sequences of "
            "max_model_len=%d",
            num_blocks,
            self.block_size,
            num_blocks * self.layout(num_blocks).bytes_per_block / 2**30,
            num_blocks * self.block_size,
            num_blocks * self.block_size / max_len,
            max_len,
        )
        return num_blocks
