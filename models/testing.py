"""Random params of any config's shapes, for tests that compare two ways of running a model."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .llama import Params, param_shapes


def random_params(config: ModelConfig, seed: int = 0, scale: float = 0.3) -> Params:
    """Host (numpy) float32 params, every leaf drawn from N(0, scale)."""
    rng = np.random.default_rng(seed)

    def make(shape):
        if isinstance(shape, dict):
            return {k: make(v) for k, v in shape.items()}
        return rng.normal(0, scale, shape).astype(np.float32)

    return make(param_shapes(config))
