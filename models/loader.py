"""Load a Hugging Face checkpoint (safetensors) into its family's stacked params pytree.

Tensors are read straight from the safetensors files (memory-mapped, safetensors_index.py, so
bfloat16 needs no torch), fused by the family's weight-name mapping (its
``ModelFamily.load_host_params``, found by models/registry.py) into the layout of its
``param_shapes`` on the host (HF weights are [out, in] like the params, so this only
reshapes and stacks), then put on the device once per leaf by `put_on_device`, the single
place where a per-leaf sharding (tensor parallelism) is applied.

Default dtype (`dtype=None`): on an accelerator (GPU/TPU) the checkpoint's half dtype
(`torch_dtype` bfloat16 or float16), otherwise bfloat16; on CPU always float32, because XLA's
CPU backend has no fast half-precision matmuls and float32 holds any bf16/fp16 checkpoint exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from .config import ModelConfig
from .gguf_params import has_quantized_weights, load_gguf_host_params
from .hub import resolve_model_path
from .quant import GroupedWeight, QuantizedWeight, check_quantization, quantize_params
from .quant.checkpoint import CheckpointQuantization, checkpoint_quantization, resolve_quantization
from .quant.grouped import grouped_sharding_tree
from .quant.prequantized import check_prequantized, finish_buffers, prequantized_reading
from .quant.weights import METHODS
from .registry import family_of, load_config
from .safetensors_index import SafetensorsIndex, TensorError, safetensors_files
from .types import Params

__all__ = [
    "DTYPES",
    "HostTransform",
    "SafetensorsIndex",
    "Shardings",
    "TensorError",
    "load_eos_token_ids",
    "load_host_params",
    "load_model",
    "load_tokenizer",
    "put_on_device",
    "safetensors_files",
    "scales_sharding",
]

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# A sharding per leaf: a pytree shaped like the params, or a function of (leaf path, shape).
Shardings = Any | Callable[[str, tuple[int, ...]], Any]
HostTransform = Callable[[ModelConfig, dict[str, Any]], tuple[ModelConfig, dict[str, Any]]]


# ---------------------------------------------------------------------------- layout


def _choose_dtype(dtype: str | None, config: ModelConfig) -> np.dtype:
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        return np.dtype(DTYPES[dtype])
    if jax.default_backend() == "cpu":
        return np.dtype(np.float32)
    if config.torch_dtype in ("bfloat16", "float16"):
        return np.dtype(DTYPES[config.torch_dtype])
    return np.dtype(ml_dtypes.bfloat16)


class _Reader:
    """Fetches a tensor by HF name, checking presence and shape, cast to the target dtype."""

    def __init__(self, st: SafetensorsIndex, dtype: np.dtype, folder: str, bar):
        self.st, self.dtype, self.folder, self.bar = st, dtype, folder, bar

    def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.st:
            raise TensorError(
                f"missing tensor {name!r} (expected shape {shape}) in checkpoint {self.folder!r}"
            )
        got = self.st.shape(name)
        if got != tuple(shape):
            raise TensorError(
                f"tensor {name!r} has shape {got}, expected {tuple(shape)} for this config "
                f"(checkpoint {self.folder!r})"
            )
        self.bar.update(1)
        return np.asarray(self.st.get(name), dtype=self.dtype)


def load_host_params(
    folder: str,
    config: ModelConfig,
    dtype: np.dtype,
    *,
    progress: bool = True,
    prequantized: CheckpointQuantization | None = None,
) -> dict[str, Any]:
    """Read and fuse the checkpoint into host numpy arrays shaped as the family's
    ``param_shapes``, through the family's weight-name mapping (``prequantized``: its linear
    weights read as stored, into quantized weights)."""
    family = family_of(config)
    st = SafetensorsIndex(safetensors_files(folder))
    shapes = family.param_shapes(config)
    with tqdm(
        total=len(st), desc="loading weights", unit="tensor", disable=not progress, leave=False
    ) as bar:
        read = _Reader(st, dtype, folder, bar)
        layers = {k: np.empty(s, dtype=dtype) for k, s in shapes["layers"].items()}
        if prequantized is not None:  # the one hook: quantized readers and stacked buffers
            read, layers = prequantized_reading(st, read, prequantized, config, folder, dtype)
        host = family.load_host_params(read, config, layers)
    return {**host, "layers": finish_buffers(host["layers"])}


def _leaf_sharding(shardings: Shardings | None, path: str, shape, sub: Any) -> Any:
    if shardings is None:
        return None
    if callable(shardings):
        return shardings(path, shape)
    return sub


def put_on_device(host: Mapping[str, Any], shardings: Shardings | None = None) -> Params:
    """Copy host arrays to the device, one `jax.device_put` per leaf.

    `shardings` is None (default device), a pytree of shardings with the params' structure, or
    a callable `(leaf_path like "layers/wqkv", shape) -> sharding | None`.
    """

    def put(node: Any, shard_node: Any, prefix: str) -> Any:
        if isinstance(node, Mapping):
            return {
                k: put(
                    v,
                    shard_node[k] if isinstance(shard_node, Mapping) else shard_node,
                    f"{prefix}{k}" if not prefix else f"{prefix}/{k}",
                )
                for k, v in node.items()
            }
        sharding = _leaf_sharding(shardings, prefix, node.shape, shard_node)
        if isinstance(node, QuantizedWeight):  # the scales split where the values do
            if sharding is None:
                return jax.device_put(node)
            return QuantizedWeight(
                jax.device_put(node.values, sharding),
                jax.device_put(node.scales, scales_sharding(sharding, node)),
            )
        if isinstance(node, GroupedWeight):  # K splits only at group boundaries
            if sharding is None:
                return jax.device_put(node)
            return jax.device_put(node, grouped_sharding_tree(sharding, node, prefix))
        # device_put copies without compiling (jnp.asarray compiles a program per shape)
        return jax.device_put(node, sharding)

    return put(host, None if callable(shardings) else shardings, "")


def scales_sharding(sharding: Any, weight: QuantizedWeight) -> Any:
    """The sharding of a quantized weight's scales given its values': the same split, except
    over the contracted axes, which the scales hold once (size 1), replicated."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    kept = [
        None if s == 1 and v != 1 else axis
        for axis, s, v in zip(spec, weight.scales.shape, weight.values.shape, strict=True)
    ]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*kept))


def load_model(
    model: str | os.PathLike,
    *,
    dtype: str | None = None,
    shardings: Shardings | None = None,
    progress: bool = True,
    host_transform: HostTransform | None = None,
    quantization: str | None = None,
) -> tuple[ModelConfig, Params]:
    """Load a model of any family from a local folder or a hub id: (config, params on device).

    `dtype` is "float32", "bfloat16", "float16" or None (see the module docstring).
    `host_transform(config, host_params) -> (config, host_params)` rewrites the host arrays
    before they go to the device (tensor parallelism uses it to replicate KV heads).
    `quantization` "int8" or "fp8" quantizes the matmul weights on the host after that
    (`quant.quantize_params`), so only the quantized bytes reach the device; None or "gguf"
    keeps a GGUF import's own quantized weights (models/gguf_params.py; None: unless a
    `dtype` is given), "none" reads floats. A pre-quantized checkpoint (`quant.checkpoint`)
    is read as stored; ``quantization`` must then agree with it or be None.
    """
    folder = resolve_model_path(model)
    prequantized = checkpoint_quantization(folder)
    quantization = resolve_quantization(quantization, prequantized, folder)
    config = load_config(folder)
    np_dtype = _choose_dtype(dtype, config)
    if prequantized is not None:  # refuse before reading any weight
        check_prequantized(config, prequantized, folder)
    elif quantization is not None:
        check_quantization(config, quantization)
    if prequantized is None and _keeps_gguf_quantization(folder, config, quantization, dtype):
        host = load_gguf_host_params(folder, config, np_dtype, family_of(config))
    else:
        host = load_host_params(
            folder, config, np_dtype, progress=progress, prequantized=prequantized
        )
    if host_transform is not None:
        config, host = host_transform(config, host)
    if quantization in METHODS and prequantized is None:
        host = quantize_params(host, config, quantization)
    return config, put_on_device(host, shardings)


def _keeps_gguf_quantization(
    folder: str, config: ModelConfig, quantization: str | None, dtype: str | None
) -> bool:
    """Whether to load a GGUF import's own quantized weights: asked for ("gguf"), or by
    default (None) where the folder has them, as vLLM reads a checkpoint's quantization,
    unless a ``dtype`` is chosen (the float expansion in that dtype)."""
    if quantization not in (None, "gguf"):
        return False
    usable = (
        has_quantized_weights(folder)
        and family_of(config).refusal("gguf_quantized", config) is None
    )
    if quantization == "gguf" and not usable:
        raise ValueError(
            f"quantization='gguf' is not available for this checkpoint ({folder!r}): it reads "
            "the quantized weights of a llama, qwen2 or gemma3 GGUF file; use 'none', 'int8' or 'fp8'"
        )
    return usable and (quantization == "gguf" or dtype is None)


# tokenizer_config.json classes that AutoTokenizer maps to the generic fast tokenizer (one
# tokenizer.json, no per-model Python class)
_GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


# "auto": transformers' tokenizer; "tokenizers": jaxpaged.models.fast_tokenizer where it fits
TOKENIZER_MODES = ("auto", "tokenizers")


def load_tokenizer(path: str | os.PathLike, mode: str = "auto"):
    """The model's tokenizer: Hugging Face's (AutoTokenizer from the resolved folder), or,
    with ``mode="tokenizers"``, a :class:`~jaxpaged.models.fast_tokenizer.FastTokenizer`
    (no transformers import) where the folder declares the generic fast tokenizer.

    A folder whose tokenizer_config.json declares the generic fast tokenizer (a converted
    GGUF's, the bundled model's) loads that class directly: AutoTokenizer first reads the
    model's config through transformers' configuration module, which imports torch (seconds
    of a command's start-up on a CPU) for the same tokenizer. Model-specific classes stay
    with transformers in either mode: they may rebuild the backend from their own rules."""
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode must be one of {TOKENIZER_MODES}, got {mode!r}")
    folder = resolve_model_path(path)
    if _generic_fast_tokenizer(folder):
        if mode == "tokenizers":
            from jaxpaged.models.fast_tokenizer import FastTokenizer

            return FastTokenizer.from_folder(folder)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _generic_fast_tokenizer(folder: str) -> bool:
    """Whether AutoTokenizer would pick the generic fast tokenizer for ``folder`` on its
    declared class alone: no remote code, a tokenizer.json, no Mistral tekken.json."""
    config_path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(config_path) or not os.path.isfile(
        os.path.join(folder, "tokenizer.json")
    ):
        return False
    if os.path.exists(os.path.join(folder, "tekken.json")):
        return False
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    return (
        isinstance(config, dict)
        and config.get("tokenizer_class") in _GENERIC_TOKENIZERS
        and "auto_map" not in config
    )


def load_eos_token_ids(folder: str | os.PathLike, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (HF generate stops at either)."""
    ids = list(config.eos_token_ids)
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(ids))
