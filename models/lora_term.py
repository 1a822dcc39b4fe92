"""The low-rank term a LoRA site adds after its base matmul, for every token's adapter at
once (models/lora.py reads adapters into the site arrays; the families' forwards call
`lora_delta` at the sites their declaration names)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .layers import rms_norm

__all__ = ["LoraInputs", "lora_delta", "lora_expert_delta"]


class LoraInputs(NamedTuple):
    """What a LoRA-enabled forward reads: every slot's adapters and each token's slot."""

    # site -> (A [L, S, r', in], B [L, S, out, r']); slot 0 is zeros (no adapter)
    weights: dict[str, tuple[jax.Array, jax.Array]]
    slots: jax.Array  # int32 [T]: the adapter slot of each token, 0 = none
    active: jax.Array  # bool []: whether any token has an adapter (else the term is skipped)


def lora_delta(
    x: jax.Array,  # [T, in]: as the site's base linear_fn call receives it
    lora: LoraInputs,
    site: str,
    layer: jax.Array | int,  # int32 []
    *,
    norm: Any = None,  # models.llama.RMSNorm (weight [in], eps), as given to linear_fn
    silu_gate: jax.Array | None = None,  # [T, in]
) -> jax.Array:  # [T, out]
    """Each token's adapter term ``B[slot] @ A[slot] @ h`` with h = norm(silu(silu_gate) *
    x), the input of the base matmul (recomputed: linear_fn may fuse it into the matmul),
    for the whole batch at once: h against every slot's A, masked to the token's own slot,
    then one product with all B (exact: the other slots contribute zeros). Nothing of it
    runs (zeros) when no token has an adapter, so requests without one pay little."""
    a_all, b_all = lora.weights[site]
    a, b = a_all[layer], b_all[layer]  # [S, r', in], [S, out, r']
    num_slots = a.shape[0]

    def term(_):
        h = x if silu_gate is None else jax.nn.silu(silu_gate) * x
        if norm is not None:
            h = rms_norm(h, norm.weight, norm.eps)
        xa = jnp.einsum("ti,sri->tsr", h, a, preferred_element_type=jnp.float32)
        mine = lora.slots[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None]  # [T, S]
        xa = jnp.where(mine[:, :, None], xa, 0.0).astype(x.dtype)
        return jnp.einsum("tsr,sor->to", xa, b, preferred_element_type=jnp.float32).astype(x.dtype)

    def none(_):
        return jnp.zeros((x.shape[0], b.shape[1]), x.dtype)

    return jax.lax.cond(lora.active, term, none, None)


def lora_expert_delta(
    x: jax.Array,  # [T, in] (every expert's input) or [T, E, in] (each expert's own)
    lora: LoraInputs,
    site: str,
    layer: jax.Array | int,  # int32 []
    num_experts: int,
) -> jax.Array:  # [T, E, out]
    """Each token's adapter term for every expert of an experts site: expert e's
    ``B_e @ A_e @ x_e`` (A [S, E * r', in] and B [S, out, E * r'], expert-major), masked to
    the token's slot as in `lora_delta`; zeros when no token has an adapter."""
    a_all, b_all = lora.weights[site]
    a, b = a_all[layer], b_all[layer]
    num_slots, e = a.shape[0], num_experts
    a = a.reshape(num_slots, e, -1, a.shape[-1])  # [S, E, r', in]
    b = b.reshape(num_slots, b.shape[1], e, -1)  # [S, out, E, r']

    def term(_):
        spec = "ti,seri->tser" if x.ndim == 2 else "tei,seri->tser"
        xa = jnp.einsum(spec, x, a, preferred_element_type=jnp.float32)
        mine = lora.slots[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None]  # [T, S]
        xa = jnp.where(mine[:, :, None, None], xa, 0.0).astype(x.dtype)
        out = jnp.einsum("tser,soer->teo", xa, b, preferred_element_type=jnp.float32)
        return out.astype(x.dtype)

    def none(_):
        return jnp.zeros((x.shape[0], e, b.shape[1]), x.dtype)

    return jax.lax.cond(lora.active, term, none, None)
