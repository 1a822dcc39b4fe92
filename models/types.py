"""The types every family and the engine share: the params tree, and the attention and
matmul callables a forward delegates to. Kept apart from any one family so that families,
the registry and the engine depend on this module and not on each other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

# A model's params: a nested dict of arrays (or quantized weights) with the layers stacked
# on a leading L axis, the same tree as its family's ``param_shapes``.
Params = dict[str, Any]

# The mesh axis a params leaf's partition metadata names for its tensor-parallel split
# (nnx.Param sharding metadata; distributed/parallel.py builds its mesh over this axis).
TP_AXIS = "tp"

# ``read(hf_name, shape)``: one checkpoint tensor by its Hugging Face name, its presence and
# shape checked, in the load dtype (a family's ``load_host_params`` reads through it).
TensorReader = Callable[[str, tuple[int, ...]], np.ndarray]


class AttentionFn(Protocol):
    """Attention of one layer over the new tokens and whatever ``cache`` holds: the paged
    engine writes k and v into its KV pool and runs ragged paged attention; a dense forward
    uses `layers.dense_causal_attention`."""

    def __call__(
        self,
        q: jax.Array,  # [T, Hq, hd]
        k: jax.Array,  # [T, Hkv, hd]
        v: jax.Array,  # [T, Hkv, hd]
        layer: jax.Array | int,  # int32 []
        cache: Any,
        *,
        sm_scale: float | None = None,  # None: hd ** -0.5
        sliding_window: int | None = None,  # attend to the last this-many positions only
        soft_cap: float | None = None,
        alibi_slopes: jax.Array | None = None,  # float32 [Hq]: ALiBi biases (models/bloom.py)
    ) -> tuple[jax.Array, Any]:  # (out [T, Hq, hd], cache)
        ...


class RMSNorm(NamedTuple):
    """An RMSNorm for `LinearFn` to apply to x's rows before the product."""

    weight: jax.Array  # [K]
    eps: float


class LinearFn(Protocol):
    """Every matmul of a forward over a stacked weight, so the engine can substitute a
    native kernel that reads layer ``index`` in place and fuses the norm, the SiLU gate and
    the residual."""

    def __call__(
        self,
        x: jax.Array,  # [T, K]
        w: jax.Array,  # [L, N, K] stacked [out, in] weights, or a quant.QuantizedWeight
        index: jax.Array | int,  # int32 []
        *,
        norm: RMSNorm | None = None,
        silu_gate: jax.Array | None = None,  # [T, K]
        residual: jax.Array | None = None,  # [T, N]
    ) -> jax.Array:  # residual + norm(silu(silu_gate) * x) @ w[index].T  [T, N]
        ...
