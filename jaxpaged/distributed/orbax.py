"""Orbax checkpoints of a model's params: written once (``python -m jaxpaged.convert``), then
restored straight onto the shards of any mesh.

A converted model folder holds ``params/`` (Orbax, in the fused, stacked layout of
``models.llama``, so restoring needs no transposes or fusing), ``config.json``, the tokenizer
and generation files copied from the source, and ``jaxpaged_orbax.json`` (the marker
``LLM(model=OUT)`` detects). Restoring reads every shard straight onto its device for any mesh
(``tensor_parallel_size``); Orbax reads only the slices each process needs, so several hosts
restore in parallel. When the mesh needs replicated KV heads (see
``jaxpaged.distributed.parallel``), the three attention leaves are read on the host, rewritten
and then sent to their shards.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from jaxpaged.distributed import parallel
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.registry import family_of, load_config
from jaxpaged.models.types import Params

MARKER = "jaxpaged_orbax.json"
PARAMS_DIR = "params"
FORMAT = "jaxpaged-orbax"
FORMAT_VERSION = 2  # 2: matmul weights stored [out, in] (version 1 held them [in, out])
_KV_LEAVES = ("layers/wqkv", "layers/bqkv", "layers/wo")


def is_orbax_model(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` was written by :func:`convert` (has the marker file)."""
    return os.path.isfile(os.path.join(os.fspath(folder), MARKER))


def numpy_dtype(name: str) -> np.dtype:
    from jaxpaged.models.loader import DTYPES

    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return np.dtype(DTYPES[name])


def save_params(params: Params, out: str | os.PathLike, *, dtype: str, source: str = "") -> None:
    """Write params (on any devices or mesh, in the un-replicated layout of the folder's
    config.json) as ``out/params`` plus the marker file. ``out`` must already hold the
    config and tokenizer files."""
    import orbax.checkpoint as ocp

    out = os.path.abspath(os.fspath(out))
    # Uncompressed: weights barely compress and zstd decoding made restores ~2x slower
    # than reading safetensors on a small CPU; uncompressed they are faster.
    handler = ocp.PyTreeCheckpointHandler(use_zarr3=False, use_compression=False)
    ocp.Checkpointer(handler).save(os.path.join(out, PARAMS_DIR), params)
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump(
            {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype, "source": source},
            f,
            indent=2,
        )


def _read_marker(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, MARKER)) as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT or marker.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{os.path.join(folder, MARKER)!r}: unsupported format {marker.get('format')!r} "
            f"version {marker.get('version')!r} (expected {FORMAT!r} {FORMAT_VERSION}); "
            "convert the model again with `python -m jaxpaged.convert`"
        )
    return marker


def _walk(tree: Any, fn, prefix: str = "") -> Any:
    if isinstance(tree, dict):
        return {k: _walk(v, fn, f"{prefix}/{k}" if prefix else k) for k, v in tree.items()}
    return fn(prefix, tree)


def restore(
    folder: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: str | None = None,
) -> tuple[ModelConfig, Params]:
    """(config, params) of an Orbax model folder, each leaf restored onto its shards of
    ``mesh`` (None: the default device). ``dtype`` None: float32 on CPU (as the safetensors
    loader), else the saved dtype. The config is the one the sharded model runs with."""
    import orbax.checkpoint as ocp
    from jax.sharding import SingleDeviceSharding

    folder = os.path.abspath(os.fspath(folder))
    marker = _read_marker(folder)
    config = load_config(folder)
    if dtype is None:
        dtype = "float32" if jax.default_backend() == "cpu" else marker["dtype"]
    np_dtype = numpy_dtype(dtype)
    n = parallel.mesh_size(mesh)
    on_host = parallel.kv_replication(config, n) > 1  # KV leaves need rewriting first
    run_config = parallel.tp_config(config, n)
    run_shapes = family_of(run_config).param_shapes(run_config)
    shard_fn = (
        parallel.param_sharding_fn(mesh, config)
        if mesh is not None
        else (lambda path, shape: SingleDeviceSharding(jax.devices()[0]))
    )

    def restore_arg(path: str, shape: tuple[int, ...]) -> Any:
        if on_host and path in _KV_LEAVES:
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=np_dtype)
        return ocp.ArrayRestoreArgs(
            sharding=shard_fn(path, shape), global_shape=tuple(shape), dtype=np_dtype
        )

    args = _walk(family_of(config).param_shapes(config), restore_arg)
    restored = ocp.PyTreeCheckpointer().restore(os.path.join(folder, PARAMS_DIR), restore_args=args)
    if not on_host:
        return config, restored
    _, params = parallel.replicate_kv_heads(config, restored, n)
    layers = dict(params["layers"])
    for path in _KV_LEAVES:
        name = path.split("/")[1]
        if name in layers:
            shape = run_shapes["layers"][name]
            layers[name] = jax.device_put(layers[name], shard_fn(path, shape))
    params["layers"] = layers
    return run_config, params
