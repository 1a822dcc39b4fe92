"""Quantize a params tree at load: every matmul weight its family declares
(`ModelFamily.matmul_weights`: the leaves its forward passes to ``linear_fn``) becomes a
`QuantizedWeight`; norms, biases, the embedding tables, the MoE router and experts (XLA
einsums of their own) stay float."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..registry import check_feature, declared_family
from .grouped import GroupedWeight
from .weights import METHODS, QuantizedWeight, quantize_array

__all__ = ["QUANTIZATIONS", "check_quantization", "is_quantized", "quantize_params", "weight_bytes"]

# The `quantization` settings: the methods `quantize_params` applies to a float checkpoint,
# "gguf" (a GGUF import's own quantized weights, models/gguf_params.py; what a GGUF model is
# served with by default) and "none" (floats: a GGUF model's float expansion).
QUANTIZATIONS = (*METHODS, "gguf", "none")


def is_quantized(params: Any) -> bool:
    """Whether any leaf of ``params`` is a `QuantizedWeight` or a `GroupedWeight`."""
    if isinstance(params, QuantizedWeight | GroupedWeight):
        return True
    if isinstance(params, Mapping):
        return any(is_quantized(v) for v in params.values())
    return False


def check_quantization(config: ModelConfig, method: str) -> None:
    """ValueError unless ``method`` is a known quantization that applies to ``config``'s
    family (checked before any weight is read)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization: {method!r} is not one of {', '.join(QUANTIZATIONS)}")
    if method == "none":
        return
    # "gguf": a GGUF import's own weights (models/gguf_params.py), which the family reads
    feature = "gguf_quantized" if method == "gguf" else "quantization"
    check_feature(config, feature, f"quantization={method!r}")


def quantize_params(params: Mapping[str, Any], config: ModelConfig, method: str) -> dict:
    """Host params (numpy, the family's ``param_shapes`` tree) with the decoder matmul
    weights its family declares quantized by ``method`` ("int8" or "fp8", per output
    channel).

    The vocabulary projection (lm_head, or the tied embedding) is quantized for int8 only.
    fp8 leaves it float, as vLLM's fp8 at load does (Fp8Config.get_quant_method in
    vllm/model_executor/layers/quantization/fp8.py quantizes only LinearBase layers; the LM
    head is a ParallelLMHead): on the bundled SmolLM2 a per-channel fp8 head adds about as
    much perplexity as every decoder layer together. A per-channel int8 head costs +0.01 %
    perplexity and saves a fifth of a small model's streamed bytes, so int8 quantizes it
    (tied embeddings keep the float table for the lookup and get an int8 "lm_head")."""
    check_quantization(config, method)
    if method == "none":
        return dict(params)
    if method == "gguf":
        raise ValueError(
            "quantization='gguf' keeps a GGUF model's own quantized weights when it is loaded; "
            "float params have none (use 'int8' or 'fp8')"
        )
    if is_quantized(params):
        raise ValueError(f"quantization={method!r}: the params are already quantized")
    family = declared_family(config)
    if family is None:
        raise ValueError(
            f"quantization={method!r} quantizes the matmul weights a jaxpaged family declares; "
            "a model of your own declares none (quantize its weights yourself)"
        )
    if not family.matmul_weights:
        raise ValueError(
            f"quantization={method!r}: the {family.name} family declares no matmul weights"
        )
    layers = dict(params["layers"])
    for name, in_axes in family.matmul_weights.items():
        if name in layers:
            layers[name] = quantize_array(layers[name], in_axes, method)
    out = {**params, "layers": layers}
    if method == "int8":
        head = params["lm_head"] if "lm_head" in params else params["embed"]
        out["lm_head"] = quantize_array(head, 1, method)
    return out


def weight_bytes(params: Any) -> int:
    """Bytes of every array in ``params`` (values, scales and mins of quantized weights)."""
    if isinstance(params, Mapping):
        return sum(weight_bytes(v) for v in params.values())
    if isinstance(params, QuantizedWeight | GroupedWeight):
        return params.nbytes
    return int(np.asarray(params).nbytes) if not hasattr(params, "nbytes") else int(params.nbytes)
