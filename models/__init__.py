"""Flax NNX models (the families models/registry.py finds by architecture; your own,
docs/models.md), their safetensors/hub loader and the bundled model."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, RopeScaling
from .hub import ModelNotFoundError, resolve_model_path
from .layers import dense_causal_attention
from .llama import LlamaForCausalLM, compute_logits, forward, param_shapes
from .loader import TensorError, load_model, load_tokenizer, put_on_device
from .registry import load_config, parse_config
from .types import AttentionFn, LinearFn, Params

__all__ = [
    "AttentionFn",
    "LinearFn",
    "Params",
    "LlamaForCausalLM",
    "SUPPORTED_MODEL_TYPES",
    "ModelConfig",
    "ModelNotFoundError",
    "RopeScaling",
    "TensorError",
    "compute_logits",
    "convert_gguf",
    "default_model_path",
    "dense_causal_attention",
    "forward",
    "load_config",
    "load_model",
    "load_tokenizer",
    "param_shapes",
    "parse_config",
    "put_on_device",
    "resolve_model_path",
]


def __getattr__(name: str) -> Any:
    # The GGUF importer and the bundled model live in their own modules (imported on first use so
    # that `import jaxpaged.models` stays light and does not require them).
    if name == "default_model_path":
        from .bundled import default_model_path

        return default_model_path
    if name == "SUPPORTED_MODEL_TYPES":  # every family's, which imports every family
        from .registry import supported_model_types

        return supported_model_types()
    if name == "convert_gguf":
        from .gguf import convert_gguf

        return convert_gguf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
