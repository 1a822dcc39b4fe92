"""The linears of a family: `Linear`, the one declaration of a matmul weight (its params
leaf, its ``[L', out, in]`` view, the axis tensor parallelism splits, the axes it contracts,
its pre-quantized checkpoint modules and its LoRA sites), from which the family's tensor
parallel, quantization and CPU packing tables all derive; the default `LinearFn` (XLA's dot
over one layer of a stacked [L, out, in] weight, float or quantized); and the generic weight
maps a platform uses over a family's declarations: every matmul weight in its view
(``map_matmul_weights``, which the CPU platform packs for its native matmul) and the arrays
every step streams (``streamed_weights``, which it backs with huge pages). Kept apart from
any one family, so every family imports it and none imports another for it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .family import Linear, linear_splits
from .layers import rms_norm
from .quant.matmul import QUANTIZED_WEIGHTS, quantized_matmul
from .types import TP_AXIS, Params, RMSNorm

__all__ = [
    "TP_AXIS",
    "Linear",
    "linear_splits",
    "linear_xla",
    "map_matmul_weights",
    "matmul_views",
    "streamed_weights",
    "vocab_projection",
]


def matmul_views(layers: Mapping[str, Any], linears: Iterable[Linear]) -> dict[str, Any]:
    """Every declared linear's ``[L', out, in]`` view, by leaf (a leaf this config's params
    lack is skipped: the Llama family's dense MLP under mixture-of-experts)."""
    return {lin.leaf: lin.view(layers[lin.leaf]) for lin in linears if lin.leaf in layers}


def linear_xla(
    x: jax.Array,  # [T, K]
    w: jax.Array,  # [L, N, K]: a stack of [out, in] weights
    index: jax.Array | int,  # int32 []: which of the L
    *,
    norm: RMSNorm | None = None,
    silu_gate: jax.Array | None = None,  # [T, K]
    residual: jax.Array | None = None,  # [T, N]
) -> jax.Array:  # [T, N]
    """(residual +) norm(silu(silu_gate) * x) @ w[index].T as one 2-D dot contracting both
    minor axes (multi-axis einsums and [in, out] weights are slower for few rows on XLA:CPU:
    measured side by side)."""
    if silu_gate is not None:
        x = jax.nn.silu(silu_gate) * x
    if norm is not None:
        x = rms_norm(x, norm.weight, norm.eps)
    if isinstance(w, QUANTIZED_WEIGHTS):  # dequantized in or just before the dot (quant/matmul.py)
        y = quantized_matmul(x, w[index])
    else:
        y = jnp.einsum("ti,oi->to", x, w[index])
    return y if residual is None else residual + y


def vocab_projection(params: Params) -> Any:  # [V, D]
    """The vocabulary projection: "lm_head", absent for tied embeddings unless
    `map_matmul_weights` (or int8 quantization) added the projection's own copy, else the
    embedding table."""
    return params["lm_head"] if "lm_head" in params else params["embed"]


def map_matmul_weights(
    params: Params, linears: Iterable[Linear], fn: Callable[[jax.Array], jax.Array]
) -> Params:
    """New params with ``fn`` applied to every declared linear's weight in its ``linear_fn``
    view ([L', out, in], `Linear.view`), and to the vocabulary projection as [1, V, D],
    stored as "lm_head" even when tied, since the embedding lookup needs the original. For
    kernels that want their own layout of the same shape (kernels.cpu.pack_panels); such
    params only work with the ``linear_fn`` that expects that layout."""
    layers = dict(params["layers"])
    for name, view in matmul_views(layers, linears).items():
        packed = fn(view)
        # a weight ``fn`` keeps as it is stays the leaf it was (reshaping it back would
        # copy it, and compile a program, for nothing)
        layers[name] = layers[name] if packed is view else packed.reshape(layers[name].shape)
    out = {**params, "layers": layers}
    projection = vocab_projection(params)
    stacked = projection[None]
    packed = fn(stacked)
    out["lm_head"] = projection if packed is stacked else packed[0]
    return out


def streamed_weights(params: Params) -> list[jax.Array]:
    """The arrays every decode step reads in full: each layer's weights, norms and biases and
    the vocabulary projection (not the embedding tables, of which a step reads a few rows,
    unless the token table doubles as the projection)."""
    return [*jax.tree.leaves(params["layers"]), *jax.tree.leaves(vocab_projection(params))]
