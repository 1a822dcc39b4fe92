"""Loading a model's params onto one device or the shards of a mesh, from a Hugging Face
folder or an Orbax folder (``python -m jaxpaged.convert``)."""

from __future__ import annotations

import os
from typing import Any

from jax.sharding import Mesh

from jaxpaged.distributed import orbax
from jaxpaged.distributed.parallel import (
    kv_replication,
    mesh_size,
    param_sharding_fn,
    replicate_kv_heads,
)
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.registry import load_config
from jaxpaged.models.types import Params


def load_params(
    folder: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    dtype: str | None = None,
    progress: bool = True,
    quantization: str | None = None,
) -> tuple[ModelConfig, Params]:
    """(config, params) from a Hugging Face folder or an Orbax folder written by
    ``python -m jaxpaged.convert``, each weight sent straight to its shards on ``mesh``
    (None: the default device). The config is the one the sharded model runs with."""
    from jaxpaged.models.loader import load_model

    folder = os.fspath(folder)
    if orbax.is_orbax_model(folder):
        if quantization is not None:
            raise ValueError(
                f"quantization={quantization!r} is not supported for Orbax folders yet "
                "(load the Hugging Face checkpoint instead)"
            )
        return orbax.restore(folder, mesh=mesh, dtype=dtype)
    if mesh is None:
        return load_model(folder, dtype=dtype, progress=progress, quantization=quantization)
    n = mesh_size(mesh)
    config = load_config(folder)
    kv_replication(config, n)  # fail before reading any weight

    def transform(cfg: ModelConfig, host: dict[str, Any]) -> tuple[ModelConfig, dict[str, Any]]:
        return replicate_kv_heads(cfg, host, n)

    return load_model(
        folder,
        dtype=dtype,
        shardings=param_sharding_fn(mesh, config),
        progress=progress,
        host_transform=transform,
        quantization=quantization,
    )
