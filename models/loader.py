"""Load a Hugging Face Llama-family checkpoint (safetensors) into the stacked params pytree.

Tensors are read straight from the safetensors files (memory-mapped, header parsed here, so
bfloat16 needs no torch), fused into the layout of `llama.param_shapes` on the host (HF
weights are [out, in] like the params, so this only reshapes and stacks), then put on the
device once per leaf by `put_on_device`, the single place where a per-leaf sharding (tensor
parallelism) is applied.

Default dtype (`dtype=None`): on an accelerator (GPU/TPU) the checkpoint's half dtype
(`torch_dtype` bfloat16 or float16), otherwise bfloat16; on CPU always float32, because XLA's
CPU backend has no fast half-precision matmuls and float32 holds any bf16/fp16 checkpoint exactly.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from .config import BLOOM_MODEL_TYPES, GEMMA_MODEL_TYPES, GPT_MODEL_TYPES, ModelConfig
from .gguf_params import GGUF_KEPT_MODEL_TYPES, has_quantized_weights, load_gguf_host_params
from .hub import resolve_model_path
from .llama import Params, param_shapes
from .quant import GroupedWeight, QuantizedWeight, check_quantization, quantize_params
from .quant.checkpoint import CheckpointQuantization, checkpoint_quantization, resolve_quantization
from .quant.grouped import grouped_sharding_tree
from .quant.prequantized import check_prequantized, finish_buffers, prequantized_reading
from .quant.weights import METHODS

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

# A sharding per leaf: a pytree shaped like the params, or a function of (leaf path, shape).
Shardings = Any | Callable[[str, tuple[int, ...]], Any]
HostTransform = Callable[[ModelConfig, dict[str, Any]], tuple[ModelConfig, dict[str, Any]]]


class TensorError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape."""


# ---------------------------------------------------------------------------- safetensors


def _read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path!r} is not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsIndex:
    """Lazily read named tensors from one or more safetensors files (memory-mapped)."""

    def __init__(self, files: list[str]):
        self.files = files
        self._where: dict[str, tuple[str, dict[str, Any], int]] = {}
        for path in files:
            header, offset = _read_safetensors_header(path)
            for name, info in header.items():
                self._where[name] = (path, info, offset)
        self._maps: dict[str, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        path, info, offset = self._where[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise TensorError(f"tensor {name!r}: unsupported safetensors dtype {info['dtype']!r}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        buf = self._maps[path][offset + begin : offset + end]
        return buf.view(dtype).reshape(info["shape"])


def safetensors_files(folder: str) -> list[str]:
    """The weight files of a model folder: sharded via model.safetensors.index.json, or single."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {folder!r}")
    return [os.path.join(folder, n) for n in found]


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


def _hf_layer_tensors(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """HF name -> expected shape for layer i."""
    c = config
    p = f"model.layers.{i}."
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    names = {
        p + "input_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (c.num_heads * hd, d),
        p + "self_attn.k_proj.weight": (c.num_kv_heads * hd, d),
        p + "self_attn.v_proj.weight": (c.num_kv_heads * hd, d),
        p + "self_attn.o_proj.weight": (d, c.num_heads * hd),
        p + "post_attention_layernorm.weight": (d,),
        p + "mlp.gate_proj.weight": (f, d),
        p + "mlp.up_proj.weight": (f, d),
        p + "mlp.down_proj.weight": (d, f),
    }
    if c.num_experts:  # Mixtral: a router and E experts (w1 gate, w3 up, w2 down)
        del names[p + "mlp.gate_proj.weight"], names[p + "mlp.up_proj.weight"]
        del names[p + "mlp.down_proj.weight"]
        moe, (gate, up, down) = _moe_names(c)
        names[p + moe + "gate.weight"] = (c.num_experts, d)
        for e in range(c.num_experts):
            names[p + moe + f"experts.{e}.{gate}.weight"] = (f, d)
            names[p + moe + f"experts.{e}.{up}.weight"] = (f, d)
            names[p + moe + f"experts.{e}.{down}.weight"] = (d, f)
    if c.model_type == "phi3":  # q, k, v fused in one projection; gate and up in another
        for name in ("q_proj", "k_proj", "v_proj"):
            del names[p + f"self_attn.{name}.weight"]
        del names[p + "mlp.gate_proj.weight"], names[p + "mlp.up_proj.weight"]
        names[p + "self_attn.qkv_proj.weight"] = ((c.num_heads + 2 * c.num_kv_heads) * hd, d)
        names[p + "mlp.gate_up_proj.weight"] = (2 * f, d)
    if c.qkv_bias:
        names[p + "self_attn.q_proj.bias"] = (c.num_heads * hd,)
        names[p + "self_attn.k_proj.bias"] = (c.num_kv_heads * hd,)
        names[p + "self_attn.v_proj.bias"] = (c.num_kv_heads * hd,)
    if c.qk_norm:
        names[p + "self_attn.q_norm.weight"] = (hd,)
        names[p + "self_attn.k_norm.weight"] = (hd,)
    return names


def _moe_names(config: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    """The sparse MLP's module prefix in a layer and its experts' gate, up and down names."""
    if config.model_type == "mixtral":
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


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


def _fill_layer(out: dict[str, np.ndarray], i: int, read: _Reader, config: ModelConfig) -> None:
    """Write layer i of the stacked, fused host arrays from its HF tensors."""
    c = config
    p = f"model.layers.{i}."
    shapes = _hf_layer_tensors(c, i)
    g, hkv, hd, d = c.queries_per_kv, c.num_kv_heads, c.head_dim, c.hidden_size
    r = lambda n: read(p + n, shapes[p + n])

    out["attn_norm"][i] = r("input_layernorm.weight")
    out["mlp_norm"][i] = r("post_attention_layernorm.weight")
    if c.model_type == "phi3":
        qkv = r("self_attn.qkv_proj.weight")  # rows: q heads, then k heads, then v heads
        q_rows, kv_rows = c.num_heads * hd, hkv * hd
        wq, wk, wv = np.split(qkv, [q_rows, q_rows + kv_rows])
        wg, wu = np.split(r("mlp.gate_up_proj.weight"), 2)  # gate rows, then up rows
    else:
        wq, wk, wv = (r(f"self_attn.{n}_proj.weight") for n in "qkv")
    wqkv = out["wqkv"][i]  # [Hkv, G + 2, hd, D]
    wqkv[:, :g] = wq.reshape(hkv, g, hd, d)
    wqkv[:, g] = wk.reshape(hkv, hd, d)
    wqkv[:, g + 1] = wv.reshape(hkv, hd, d)
    if c.qkv_bias:
        bqkv = out["bqkv"][i]  # [Hkv, G + 2, hd]
        bqkv[:, :g] = r("self_attn.q_proj.bias").reshape(hkv, g, hd)
        bqkv[:, g] = r("self_attn.k_proj.bias").reshape(hkv, hd)
        bqkv[:, g + 1] = r("self_attn.v_proj.bias").reshape(hkv, hd)
    if c.qk_norm:
        out["q_norm"][i] = r("self_attn.q_norm.weight")
        out["k_norm"][i] = r("self_attn.k_norm.weight")
    out["wo"][i] = r("self_attn.o_proj.weight").reshape(d, hkv, g, hd)
    if c.num_experts:
        moe, (gate, up, down) = _moe_names(c)
        out["router"][i] = r(moe + "gate.weight")
        for e in range(c.num_experts):
            expert = f"{moe}experts.{e}."
            out["w_experts_gate_up"][i, e, 0] = r(expert + gate + ".weight")
            out["w_experts_gate_up"][i, e, 1] = r(expert + up + ".weight")
            out["w_experts_down"][i, e] = r(expert + down + ".weight")
        return
    if c.model_type != "phi3":
        wg, wu = r("mlp.gate_proj.weight"), r("mlp.up_proj.weight")
    out["w_gate_up"][i, 0] = wg
    out["w_gate_up"][i, 1] = wu
    out["w_down"][i] = r("mlp.down_proj.weight")


def _num_tensors(config: ModelConfig) -> int:
    return (
        2
        + (0 if config.tie_word_embeddings else 1)
        + config.num_layers * len(_hf_layer_tensors(config, 0))
    )


def load_host_params(
    folder: str,
    config: ModelConfig,
    dtype: np.dtype,
    *,
    progress: bool = True,
    prequantized: CheckpointQuantization | None = None,
) -> dict[str, Any]:
    """Read and fuse the checkpoint into host numpy arrays shaped as `llama.param_shapes`
    (``prequantized``: its linear weights read as stored, into quantized weights)."""
    st = SafetensorsIndex(safetensors_files(folder))
    if config.model_type in GPT_MODEL_TYPES:
        from . import gpt

        with tqdm(desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar:
            return gpt.load_host_params(_Reader(st, dtype, folder, bar), config, dtype)
    if config.model_type in GEMMA_MODEL_TYPES:
        from . import gemma

        with tqdm(desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar:
            return gemma.load_host_params(_Reader(st, dtype, folder, bar), config, dtype)
    if config.model_type in BLOOM_MODEL_TYPES:
        from . import bloom

        with tqdm(desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar:
            return bloom.load_host_params(_Reader(st, dtype, folder, bar), config, dtype)
    shapes = param_shapes(config)
    with tqdm(
        total=_num_tensors(config),
        desc="loading weights",
        unit="tensor",
        disable=not progress,
        leave=False,
    ) as bar:
        read = _Reader(st, dtype, folder, bar)
        layers = {k: np.empty(s, dtype=dtype) for k, s in shapes["layers"].items()}
        if prequantized is not None:  # the one hook: quantized readers and stacked buffers
            read, layers = prequantized_reading(st, read, prequantized, config, folder, dtype)
        for i in range(config.num_layers):
            _fill_layer(layers, i, read, config)
        layers = finish_buffers(layers)
        d, v = config.hidden_size, config.vocab_size
        host: dict[str, Any] = {
            "embed": read("model.embed_tokens.weight", (v, d)),
            "layers": layers,
            "final_norm": read("model.norm.weight", (d,)),
        }
        if not config.tie_word_embeddings:
            host["lm_head"] = read("lm_head.weight", (v, d))
    return host


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
                return jax.tree.map(jnp.asarray, node)
            return QuantizedWeight(
                jax.device_put(node.values, sharding),
                jax.device_put(node.scales, scales_sharding(sharding, node)),
            )
        if isinstance(node, GroupedWeight):  # K splits only at group boundaries
            if sharding is None:
                return jax.tree.map(jnp.asarray, node)
            return jax.device_put(node, grouped_sharding_tree(sharding, node, prefix))
        return jax.device_put(node, sharding) if sharding is not None else jnp.asarray(node)

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
    """Load a Llama-family model from a local folder or a hub id: (config, params on device).

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
    config = ModelConfig.from_pretrained(folder)
    np_dtype = _choose_dtype(dtype, config)
    if prequantized is not None:  # refuse before reading any weight
        check_prequantized(config, prequantized, folder)
    elif quantization is not None:
        check_quantization(config, quantization)
    if prequantized is None and _keeps_gguf_quantization(folder, config, quantization, dtype):
        host = load_gguf_host_params(folder, config, np_dtype)
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
    usable = has_quantized_weights(folder) and config.model_type in GGUF_KEPT_MODEL_TYPES
    if quantization == "gguf" and not usable:
        raise ValueError(
            f"quantization='gguf' is not available for this checkpoint ({folder!r}): it reads "
            "the quantized weights of a llama, qwen2 or gemma3 GGUF file; use 'none', 'int8' or 'fp8'"
        )
    return usable and (quantization == "gguf" or dtype is None)


def load_tokenizer(path: str | os.PathLike):
    """The model's Hugging Face tokenizer (AutoTokenizer from the resolved folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(path))


def load_eos_token_ids(folder: str | os.PathLike, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (HF generate stops at either)."""
    ids = list(config.eos_token_ids)
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(ids))
