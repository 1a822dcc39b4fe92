"""The paged-model protocol: what the engine needs of a Flax NNX module to serve it
(docs/models.md), and the check that refuses a module that lacks it, naming what is missing."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from .config import ModelConfig
from .types import AttentionFn


@runtime_checkable
class PagedModel(Protocol):
    """An NNX module the engine can serve. ``config`` sizes the KV pool (num_layers,
    num_kv_heads, head_dim), the vocabulary and the context (max_position_embeddings);
    the engine runs ``nnx.merge(graphdef, state)`` inside its jitted step."""

    config: ModelConfig

    def __call__(
        self,
        tokens: jax.Array,  # int32 [T]: the new tokens of every sequence, concatenated
        positions: jax.Array,  # int32 [T]: each token's position in its sequence
        attention_fn: AttentionFn,
        cache: Any,
    ) -> tuple[jax.Array, Any]:  # (hidden [T, D], cache)
        """Every layer l calls ``out, cache = attention_fn(q, k, v, l, cache)`` once, with
        q [T, Hq, hd] (rotary already applied), k and v [T, Hkv, hd]; it returns out
        [T, Hq, hd]. Keyword options: sm_scale (default hd**-0.5), sliding_window,
        soft_cap, alibi_slopes (float32 [Hq]: ALiBi, ``slopes[h] * (key_pos - query_pos)``
        added to head h's logits)."""
        ...

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [S, D] -> [S, V]
        ...


def check_paged_model(model: Any) -> ModelConfig:
    """The module's config; ValueError naming what a module of the protocol lacks."""
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise ValueError(
            f"{type(model).__name__}.config must be a jaxpaged.models.ModelConfig "
            "(it sizes the KV pool); see docs/models.md"
        )
    for name in ("__call__", "compute_logits"):
        if not callable(getattr(model, name, None)):
            raise ValueError(f"{type(model).__name__} has no {name} method; see docs/models.md")
    return config
