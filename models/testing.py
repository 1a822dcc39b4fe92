"""A tiny config and random params, for tests that compare two ways of running a model."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .llama import Params, param_shapes


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Qwen2-style config (q/k/v bias, GQA 4:1, every output size a multiple of 16)."""
    base = dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=True,
    )
    return ModelConfig(**{**base, **overrides})


def random_params(config: ModelConfig, seed: int = 0, scale: float = 0.3) -> Params:
    """Host (numpy) float32 params, every leaf drawn from N(0, scale)."""
    rng = np.random.default_rng(seed)

    def make(shape):
        if isinstance(shape, dict):
            return {k: make(v) for k, v in shape.items()}
        return rng.normal(0, scale, shape).astype(np.float32)

    return make(param_shapes(config))
