"""Flax NNX models (the families models/registry.py finds by architecture; your own,
docs/models.md), their safetensors/hub loader and the bundled model.

The public names are imported on first use: `jaxpaged.models.config` (the plain config the
scheduler's settings carry) must not pull in JAX, since `sched` runs without it."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionFn": ".types",
    "LinearFn": ".types",
    "Params": ".types",
    "LlamaForCausalLM": ".llama",
    "ModelConfig": ".config",
    "ModelNotFoundError": ".hub",
    "RopeScaling": ".config",
    "TensorError": ".loader",
    "compute_logits": ".llama",
    "convert_gguf": ".gguf",
    "default_model_path": ".bundled",
    "dense_causal_attention": ".layers",
    "forward": ".llama",
    "load_config": ".registry",
    "load_model": ".loader",
    "load_tokenizer": ".loader",
    "param_shapes": ".llama",
    "parse_config": ".registry",
    "put_on_device": ".loader",
    "resolve_model_path": ".hub",
}

__all__ = sorted([*_EXPORTS, "SUPPORTED_MODEL_TYPES"])


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_MODEL_TYPES":  # every family's, which imports every family
        from .registry import supported_model_types

        return supported_model_types()
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
