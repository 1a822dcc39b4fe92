"""The KV pool an engine gets: its storage dtype, its layout for the attention backend, and
how many blocks of it fit. Kept apart from the engine's wiring because each answer depends on
the others (an 8-bit cache changes the layout, the layout changes the bytes per block)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.kernels.kv_quant import is_quantized
from jaxpaged.kernels.pool_format import pool_format
from jaxpaged.models.config import ModelConfig
from jaxpaged.worker.kv_cache import KVLayout, device_kv_budget, kv_storage_dtype, num_blocks_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVPlan:
    """What the pool stores and in which layout; ``attention_backend`` as the engine must
    run it (tensor parallelism on TPU moves the combined layout to the XLA path)."""

    model_config: ModelConfig
    block_size: int
    dtype: Any  # the pool's storage dtype
    combined: bool  # K and V in one padded pool (kernels/pool_format.py)
    attention_backend: str | None

    @classmethod
    def choose(
        cls,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        *,
        params_dtype: str,
        attention_backend: str | None,
        tensor_parallel: bool,
    ) -> KVPlan:
        kv_dtype = kv_storage_dtype(cache_config.kv_cache_dtype, params_dtype)
        quantized_kv = is_quantized(kv_dtype)
        # the pool's layout follows the attention backend; an 8-bit cache on the "tpu"
        # backend is a ValueError there
        combined_kv = pool_format(attention_backend, quantized=quantized_kv).combined
        if combined_kv and tensor_parallel:
            # the combined pool's padded heads do not split over devices like the model's
            if attention_backend == "tpu":
                raise ValueError(
                    "attention_backend='tpu' does not support tensor_parallel_size > 1 yet; "
                    "use attention_backend='xla' (--attention-backend xla)"
                )
            logger.info("tensor parallelism on TPU: the XLA attention path")
            attention_backend, combined_kv = "xla", False
        if combined_kv and model_config.alibi:
            # JAX's TPU kernel takes no logit bias
            if attention_backend == "tpu":
                from jaxpaged.kernels.tpu import refuse_alibi

                refuse_alibi(model_config.model_type)
            logger.info("ALiBi (%s) on TPU: the XLA attention path", model_config.model_type)
            attention_backend, combined_kv = "xla", False
        return cls(
            model_config=model_config,
            block_size=cache_config.block_size,
            dtype=kv_dtype,
            combined=combined_kv,
            attention_backend=attention_backend,
        )

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
            if jax.local_devices()[0].platform != "cpu":
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
