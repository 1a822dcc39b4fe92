"""The shared layers families compose their decoder layers of, over the family's declared
linears (models/family.py `Linear`): a projection with its bias and LoRA term, a pre-norm
projection (RMSNorm, then the product), a residual-added output projection (with Granite's
residual multiplier) and the gated SiLU MLP whose down projection adds to the residual.

Each calls the platform's `LinearFn` and hands it what it may fuse: the RMSNorm it applies
to x's rows as it packs them, the SiLU gate and the residual it adds as it stores the
product (the CPU's native kernel fuses all three; `linear.linear_xla` computes them as
separate ops, in the same order). So the family files say what a layer computes and never
how a platform's kernel wants it called. Each adds a LoRA site's term after its base
product (models/lora_term.py), on the same input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .family import Linear
from .linear import matmul_views
from .lora_term import LoraInputs, lora_delta
from .types import LinearFn, RMSNorm

__all__ = [
    "LayerLinears",
    "gated_silu_mlp",
    "normed_projection",
    "projection",
    "residual_projection",
]


@dataclasses.dataclass(frozen=True)
class LayerLinears:
    """One decoder layer's linears as its forward calls them: the platform's ``linear_fn``,
    every declared linear's ``[L', out, in]`` view, the layer index and the LoRA inputs
    (None: LoRA off)."""

    linear_fn: LinearFn
    views: Mapping[str, Any]  # leaf -> [L', out, in], read by linear_fn in place
    declared: Mapping[str, Linear]
    products: Mapping[str, int]  # leaf -> how many products of one layer it stacks
    layer: jax.Array | int  # int32 []
    lora: LoraInputs | None = None

    @classmethod
    def of(
        cls,
        layers: Mapping[str, Any],  # every layer's params, stacked on a leading L axis
        linears: Iterable[Linear],
        layer: jax.Array | int,  # int32 []
        linear_fn: LinearFn,
        lora: LoraInputs | None = None,
    ) -> LayerLinears:
        linears = tuple(linears)
        views = matmul_views(layers, linears)
        declared = {lin.leaf: lin for lin in linears if lin.leaf in views}
        products = {leaf: lin.products(layers[leaf]) for leaf, lin in declared.items()}
        return cls(linear_fn, views, declared, products, layer, lora)

    def index(self, leaf: str, part: int = 0) -> jax.Array | int:
        """Product ``part`` of this layer in the leaf's view (its L' is L x products)."""
        products = self.products[leaf]
        if products == 1:
            return self.layer
        first = products * self.layer
        return first + part if part else first

    def site(self, leaf: str, part: int = 0) -> str | None:
        """The LoRA site of product ``part`` (None: LoRA off or no site declared)."""
        sites = self.declared[leaf].lora
        if self.lora is None or not sites:
            return None
        return sites[part] if len(sites) > 1 else sites[0]


def projection(
    lin: LayerLinears,
    leaf: str,
    x: jax.Array,  # [T, K]
    *,
    part: int = 0,
    bias: jax.Array | None = None,  # [N]
    lora: bool = True,
) -> jax.Array:  # [T, N]
    """``x @ w.T (+ bias) (+ the LoRA term)``, in that order (as transformers adds a biased
    linear's bias before PEFT adds the adapter's output). ``lora=False``: the caller adds
    the site's term itself (one term over several products, e.g. GPT-2's q, k and v)."""
    y = lin.linear_fn(x, lin.views[leaf], lin.index(leaf, part))
    if bias is not None:
        y = y + bias
    site = lin.site(leaf, part) if lora else None
    if site is not None:
        y = y + lora_delta(x, lin.lora, site, lin.layer)
    return y


def normed_projection(
    lin: LayerLinears,
    leaf: str,
    x: jax.Array,  # [T, K], before the norm
    norm: RMSNorm,
    *,
    part: int = 0,
) -> jax.Array:  # [T, N]
    """A pre-norm projection: ``rms_norm(x) @ w.T`` (+ the LoRA term of the normed x), the
    norm fused into the product where the platform's kernel fuses it."""
    y = lin.linear_fn(x, lin.views[leaf], lin.index(leaf, part), norm=norm)
    site = lin.site(leaf, part)
    if site is not None:  # after the base call, on the same input
        y = y + lora_delta(x, lin.lora, site, lin.layer, norm=norm)
    return y


def residual_projection(
    lin: LayerLinears,
    leaf: str,
    residual: jax.Array,  # [T, N]
    x: jax.Array,  # [T, K]
    *,
    multiplier: float = 1.0,  # Granite's residual_multiplier
    silu_gate: jax.Array | None = None,  # [T, K]: x is silu(silu_gate) * x
) -> jax.Array:  # [T, N]
    """An output projection added to the residual stream: ``residual + multiplier *
    (h @ w.T + lora)`` with ``h = silu(silu_gate) * x``; with multiplier 1 the add (and the
    gate) is ``linear_fn``'s fused epilogue."""
    site = lin.site(leaf)
    delta = None
    if site is not None:
        delta = lora_delta(x, lin.lora, site, lin.layer, silu_gate=silu_gate)
    gate = {} if silu_gate is None else {"silu_gate": silu_gate}
    w, index = lin.views[leaf], lin.index(leaf)
    if multiplier == 1.0:
        out = lin.linear_fn(x, w, index, residual=residual, **gate)
        return out if delta is None else out + delta
    out = lin.linear_fn(x, w, index, **gate)
    if delta is not None:
        out = out + delta
    return residual + out * jnp.asarray(multiplier, out.dtype)


def gated_silu_mlp(
    lin: LayerLinears,
    gate_up: str,  # leaf [L, 2, F, D]: gate (product 0) and up (product 1)
    down: str,  # leaf [L, D, F]
    x: jax.Array,  # [T, D], the residual stream
    norm: RMSNorm,
    *,
    multiplier: float = 1.0,  # Granite's residual_multiplier
) -> jax.Array:  # [T, D]
    """The pre-norm gated SiLU MLP added to the residual: ``x + multiplier *
    down(silu(gate(h)) * up(h))``, h = rms_norm(x). Gate and up are two products, not one
    over a merged [2F, D]: tensor parallelism splits F, which merging would mix."""
    gate = normed_projection(lin, gate_up, x, norm, part=0)
    up = normed_projection(lin, gate_up, x, norm, part=1)
    return residual_projection(lin, down, x, up, multiplier=multiplier, silu_gate=gate)
