"""The engine builder's one call that picks the :class:`~jaxpaged.kernels.platform.Platform`:
from the devices the engine runs on, the settings and the model, before the KV plan and the
runner are made (both only read it)."""

from __future__ import annotations

import logging
from typing import Any

import jax
from flax import nnx

from jaxpaged.kernels.platform import AttentionShape, Platform, choose_platform
from jaxpaged.models.config import ModelConfig
from jaxpaged.worker.model_hooks import ModelHooks

logger = logging.getLogger(__name__)

__all__ = ["engine_platform"]


def engine_platform(
    model_config: ModelConfig,
    params: Any,
    *,
    graphdef: nnx.GraphDef | None,
    params_dtype: str,
    kv_dtype: str,
    block_size: int,
    attention_backend: str | None,
    mesh: jax.sharding.Mesh | None,
) -> Platform:
    """The platform of an engine over ``params`` (on ``mesh``'s devices, else JAX's first
    local device), logged in one line. ``params_dtype``: the model's floating-point dtype;
    ``kv_dtype``: the KV pool's storage dtype."""
    devices = jax.local_devices() if mesh is None else list(mesh.devices.flat)
    shards = 1 if mesh is None else mesh.size
    c = model_config
    shape = AttentionShape(
        num_q_heads=max(1, c.num_heads // shards),
        num_kv_heads=max(1, c.num_kv_heads // shards),
        head_dim=c.head_dim,
        block_size=block_size,
        kv_dtype=str(kv_dtype),
        q_dtype=str(params_dtype),
        alibi=bool(c.alibi),
    )
    platform = choose_platform(
        params,
        ModelHooks.of(model_config, params, graphdef).weight_map,
        device=devices[0].platform,
        attention_backend=attention_backend,
        shape=shape,
        tensor_parallel=mesh is not None,
        model_name=c.model_type,
    )
    logger.info("%s", platform.describe())
    return platform
