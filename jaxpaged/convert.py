"""``python -m jaxpaged.convert MODEL OUT``: save a model's params as an Orbax checkpoint.

The output folder is a model folder of its own: ``params/`` (Orbax, in the fused, stacked
layout of ``models.llama``, so restoring needs no transposes or fusing), ``config.json``,
the tokenizer and generation files copied from the source, and ``jaxpaged_orbax.json``
(the marker ``LLM(model=OUT)`` detects). Restoring reads every shard straight onto its
device for any mesh (``tensor_parallel_size``); Orbax reads only the slices each process
needs, so several hosts restore in parallel. When the mesh needs replicated KV heads (see
``jaxpaged.parallel``), the three attention leaves are read on the host, rewritten and then
sent to their shards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import Params, param_shapes

MARKER = "jaxpaged_orbax.json"
PARAMS_DIR = "params"
FORMAT = "jaxpaged-orbax"
FORMAT_VERSION = 2  # 2: matmul weights stored [out, in] (version 1 held them [in, out])
_KV_LEAVES = ("layers/wqkv", "layers/bqkv", "layers/wo")
_SKIP_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")


def is_orbax_model(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` was written by :func:`convert` (has the marker file)."""
    return os.path.isfile(os.path.join(os.fspath(folder), MARKER))


def _numpy_dtype(name: str) -> np.dtype:
    from jaxpaged.models.loader import DTYPES

    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return np.dtype(DTYPES[name])


def convert(
    model: str | os.PathLike | None,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    progress: bool = True,
) -> str:
    """Load ``model`` (None = bundled, folder, hub id or .gguf) and write it to ``out`` as an
    Orbax model folder; returns ``out``. ``dtype`` None keeps the checkpoint's own dtype
    (``torch_dtype`` when it is float32/bfloat16/float16, else float32)."""
    from jaxpaged.models.loader import DTYPES, load_model
    from jaxpaged.models.resolve import resolve_model_folder

    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"OUT: {out!r} exists and is not empty; choose a new folder")
    folder = resolve_model_folder(model)
    config = ModelConfig.from_pretrained(folder)
    if dtype is None:
        dtype = config.torch_dtype if config.torch_dtype in DTYPES else "float32"
    _numpy_dtype(dtype)
    _, params = load_model(folder, dtype=dtype, progress=progress)
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(folder)):
        src = os.path.join(folder, name)
        if os.path.isfile(src) and not name.endswith(_SKIP_SUFFIXES) and name != MARKER:
            shutil.copy2(src, os.path.join(out, name))
    save_params(params, out, dtype=dtype, source=str(folder))
    return out


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

    from jaxpaged import parallel

    folder = os.path.abspath(os.fspath(folder))
    marker = _read_marker(folder)
    config = ModelConfig.from_pretrained(folder)
    if dtype is None:
        dtype = "float32" if jax.default_backend() == "cpu" else marker["dtype"]
    np_dtype = _numpy_dtype(dtype)
    n = parallel.mesh_size(mesh)
    on_host = parallel.kv_replication(config, n) > 1  # KV leaves need rewriting first
    run_config = parallel.tp_config(config, n)
    run_shapes = param_shapes(run_config)
    shard_fn = (
        parallel.param_sharding_fn(mesh)
        if mesh is not None
        else (lambda path, shape: SingleDeviceSharding(jax.devices()[0]))
    )

    def restore_arg(path: str, shape: tuple[int, ...]) -> Any:
        if on_host and path in _KV_LEAVES:
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=np_dtype)
        return ocp.ArrayRestoreArgs(
            sharding=shard_fn(path, shape), global_shape=tuple(shape), dtype=np_dtype
        )

    args = _walk(param_shapes(config), restore_arg)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpaged.convert",
        description="Save a model's params as an Orbax checkpoint folder that LLM(model=OUT) "
        "and `python -m jaxpaged.serve --model OUT` restore directly into any mesh layout.",
    )
    parser.add_argument(
        "model",
        help="model folder, hub id, .gguf file, or 'bundled' for the bundled SmolLM2",
    )
    parser.add_argument("out", help="output folder (must not exist or be empty)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="dtype to store (default: the checkpoint's own)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = convert(None if args.model == "bundled" else args.model, args.out, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
