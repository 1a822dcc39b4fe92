"""Load a GGUF import's params with its matmul weights still quantized (`GroupedWeight`).

The folder written by gguf.convert_gguf holds the float expansion (model.safetensors) and
the quantized matmul weights (gguf.QUANTIZED_FILE). This reads the norms and biases from the
first and every matmul weight, the token embedding and the output projection from the second,
stacked into the family's ``param_shapes`` tree like loader.load_host_params' float
leaves (the Llama family's and Gemma's matmul layout; the family's GGUF layout names the
norms).

A stacked leaf is kept quantized only when all its parts (every layer's q, k and v for
wqkv) share one format (bits and group size); otherwise, as for a part whose GGUF type is not
read quantized (F16, Q5_K, ...), the leaf is the float expansion, which is the same numbers
(tests/quant/test_gguf_quant.py). So a Q4_K_M file, whose ffn_down mixes Q4_K and Q6_K
layers, keeps the rest quantized and expands w_down.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .config import ModelConfig
from .family import ModelFamily
from .gguf import QUANTIZED_FILE
from .quant.grouped import GroupedWeight
from .safetensors_index import SafetensorsIndex, TensorError

__all__ = ["has_quantized_weights", "load_gguf_host_params"]

Part = GroupedWeight | np.ndarray  # one HF tensor [rows, K]: kept quantized, or float


def has_quantized_weights(folder: str) -> bool:
    """Whether ``folder`` is a GGUF import with quantized matmul weights."""
    return os.path.isfile(os.path.join(folder, QUANTIZED_FILE))


def load_gguf_host_params(
    folder: str, config: ModelConfig, dtype: np.dtype, family: ModelFamily
) -> dict[str, Any]:
    """Host params of the GGUF import in ``folder`` (a model of ``family``): float leaves in
    ``dtype``, matmul leaves `GroupedWeight` where they can be (see the module docstring)."""
    reason = family.refusal("gguf_quantized", config)
    layout = family.gguf_layout(config)
    if reason is not None or layout is None:
        raise ValueError(
            f"GGUF weights of model_type {config.model_type!r} are not kept quantized: "
            f"{reason or 'its family declares no GGUF layout for it'}"
        )
    floats = SafetensorsIndex([os.path.join(folder, "model.safetensors")])
    quant = SafetensorsIndex([os.path.join(folder, QUANTIZED_FILE)])

    def read_float(name: str) -> np.ndarray:
        if name not in floats:
            raise TensorError(f"missing tensor {name!r} in checkpoint {folder!r}")
        return np.asarray(floats.get(name), dtype=dtype)

    def part(name: str, rows: int, cols: int) -> Part:
        if f"{name}.values" not in quant:
            return read_float(name)
        values, scales = quant.get(f"{name}.values"), quant.get(f"{name}.scales")
        bits = 4 if values.dtype == np.uint8 else 8
        mins = quant.get(f"{name}.mins") if bits == 4 else None
        group = cols // scales.shape[-1]
        w = GroupedWeight(values, scales, mins, (rows, cols), group, bits)
        if w.shape != (rows, cols):  # pragma: no cover - the converter wrote both
            raise TensorError(f"tensor {name!r} has shape {w.shape}, expected {(rows, cols)}")
        return w

    c = config
    d, f, hd, g, hkv = (
        c.hidden_size,
        c.intermediate_size,
        c.head_dim,
        c.queries_per_kv,
        c.num_kv_heads,
    )
    shapes = family.param_shapes(c)
    n = c.num_layers

    def qkv_rows(q: Any, k: Any, v: Any) -> Any:  # [Hq*hd | Hkv*hd | Hkv*hd, X] -> [rows, X]
        parts = [q.reshape(hkv, g * hd, -1), k.reshape(hkv, hd, -1), v.reshape(hkv, hd, -1)]
        return np.concatenate(parts, axis=1).reshape(hkv * (g + 2) * hd, -1)

    def layer_parts(i: int) -> dict[str, tuple[list[Part], Callable[..., Any]]]:
        p = f"model.layers.{i}."
        return {
            "wqkv": (
                [
                    part(p + "self_attn.q_proj.weight", c.num_heads * hd, d),
                    part(p + "self_attn.k_proj.weight", hkv * hd, d),
                    part(p + "self_attn.v_proj.weight", hkv * hd, d),
                ],
                qkv_rows,
            ),
            "wo": ([part(p + "self_attn.o_proj.weight", d, c.num_heads * hd)], _one),
            "w_gate_up": (
                [part(p + "mlp.gate_proj.weight", f, d), part(p + "mlp.up_proj.weight", f, d)],
                _concat_rows,
            ),
            "w_down": ([part(p + "mlp.down_proj.weight", d, f)], _one),
        }

    per_layer = [layer_parts(i) for i in range(n)]
    layers: dict[str, Any] = {}
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        parts = [per_layer[i][name] for i in range(n)]
        layers[name] = _stack(parts, shapes["layers"][name], dtype)
    for ours, theirs in layout.layer_norms.items():
        layers[ours] = np.stack([read_float(f"model.layers.{i}.{theirs}.weight") for i in range(n)])
    if c.qkv_bias:
        layers["bqkv"] = np.stack(
            [
                qkv_rows(
                    *(
                        read_float(f"model.layers.{i}.self_attn.{x}_proj.bias")[:, None]
                        for x in "qkv"
                    )
                ).reshape(shapes["layers"]["bqkv"][1:])
                for i in range(n)
            ]
        )
    host: dict[str, Any] = {
        "embed": _stack(
            [([part("model.embed_tokens.weight", c.vocab_size, d)], _one)], None, dtype
        ),
        "layers": layers,
        "final_norm": read_float("model.norm.weight"),
    }
    if not c.tie_word_embeddings:
        host["lm_head"] = _stack([([part("lm_head.weight", c.vocab_size, d)], _one)], None, dtype)
    return host


def _one(w: Any) -> Any:
    return w


def _concat_rows(*ws: Any) -> Any:
    return np.concatenate(ws, axis=0)


def _stack(
    layers: list[tuple[list[Part], Callable[..., Any]]],
    shape: tuple[int, ...] | None,  # the stacked leaf's shape; None: one unstacked [rows, K]
    dtype: np.dtype,
) -> Any:
    """One leaf from each layer's parts, arranged by its row function (which works alike on
    the quantized arrays and on floats): quantized if every part shares one format."""
    formats = {
        (p.bits, p.group_size) if isinstance(p, GroupedWeight) else None
        for parts, _ in layers
        for p in parts
    }
    if len(formats) != 1 or None in formats:
        stacked = np.stack(
            [arrange(*(np.asarray(_float(p), dtype) for p in parts)) for parts, arrange in layers]
        )
        return stacked.reshape(shape) if shape is not None else stacked[0]
    ((bits, group),) = formats

    def arrays(field: str) -> np.ndarray:
        out = np.stack([arrange(*(getattr(p, field) for p in parts)) for parts, arrange in layers])
        return out if shape is not None else out[0]

    k = layers[0][0][0].in_features
    values = arrays("values")
    mins = arrays("mins") if bits == 4 else None
    w = GroupedWeight(values, arrays("scales"), mins, (*values.shape[:-1], k), group, bits)
    return w.reshape(shape) if shape is not None else w


def _float(p: Part) -> np.ndarray:
    return p.dequantize(np.float32) if isinstance(p, GroupedWeight) else p
