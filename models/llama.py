"""The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, Qwen3) as a pure function of params.

Params are a plain nested dict with the layers stacked on a leading L axis, so the decoder runs
as one `lax.scan` (compile time independent of depth) and the tree shards and donates cleanly:

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D],
                "wqkv": [L, D, Hkv, G + 2, hd],   # per KV head: its G query heads, then k, then v
                "bqkv": [L, Hkv, G + 2, hd],      # only if config.qkv_bias
                "q_norm": [L, hd], "k_norm": [L, hd],  # only if config.qk_norm
                "wo": [L, Hkv, G, hd, D],
                "mlp_norm": [L, D],
                "w_gate_up": [L, D, 2, F],        # gate (index 0) and up (index 1)
                "w_down": [L, F, D]},
     "final_norm": [D],
     "lm_head": [D, V]}                           # absent when tie_word_embeddings

Attention is delegated to `attention_fn(q, k, v, layer, cache) -> (out, cache)` so the paged
engine can substitute its KV-pool write + ragged paged attention without touching the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import apply_rope, dense_causal_attention, rms_norm, rope_inv_freq

AttentionFn = Callable[
    [jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]
]  # (q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd], layer int32 [], cache) -> (out [T, Hq, hd], cache)

Params = dict[str, Any]


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The shape of every params leaf (same tree as the params), for loaders and checks."""
    c = config
    g = c.queries_per_kv
    n, d, hd, f = c.num_layers, c.hidden_size, c.head_dim, c.intermediate_size
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (n, d),
        "wqkv": (n, d, c.num_kv_heads, g + 2, hd),
        "wo": (n, c.num_kv_heads, g, hd, d),
        "mlp_norm": (n, d),
        "w_gate_up": (n, d, 2, f),
        "w_down": (n, f, d),
    }
    if c.qkv_bias:
        layers["bqkv"] = (n, c.num_kv_heads, g + 2, hd)
    if c.qk_norm:
        layers["q_norm"] = (n, hd)
        layers["k_norm"] = (n, hd)
    shapes: dict[str, Any] = {
        "embed": (c.vocab_size, d),
        "layers": layers,
        "final_norm": (d,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (d, c.vocab_size)
    return shapes


def _layer(
    x: jax.Array,  # [T, D]
    lp: dict[str, jax.Array],  # one layer's params (leading L axis removed)
    layer: jax.Array,  # int32 []
    positions: jax.Array,  # int32 [T]
    cache: Any,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn,
) -> tuple[jax.Array, Any]:
    c = config
    t = x.shape[0]
    g = c.queries_per_kv
    eps = c.rms_norm_eps
    inv_freq = rope_inv_freq(c)

    h = rms_norm(x, lp["attn_norm"], eps)
    qkv = jnp.einsum("td,dkgh->tkgh", h, lp["wqkv"])  # [T, Hkv, G + 2, hd]
    if c.qkv_bias:
        qkv = qkv + lp["bqkv"][None]
    q = qkv[:, :, :g].reshape(t, c.num_heads, c.head_dim)
    k = qkv[:, :, g]  # [T, Hkv, hd]
    v = qkv[:, :, g + 1]
    if c.qk_norm:
        q = rms_norm(q, lp["q_norm"], eps)
        k = rms_norm(k, lp["k_norm"], eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)

    attn, cache = attention_fn(q, k, v, layer, cache)  # [T, Hq, hd]
    attn = attn.astype(x.dtype).reshape(t, c.num_kv_heads, g, c.head_dim)
    x = x + jnp.einsum("tkgh,kghd->td", attn, lp["wo"])

    h = rms_norm(x, lp["mlp_norm"], eps)
    gate_up = jnp.einsum("td,dcf->tcf", h, lp["w_gate_up"])  # [T, 2, F]
    act = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
    x = x + act @ lp["w_down"]
    return x, cache


def forward(
    params: Params,
    tokens: jax.Array,  # int32 [T]
    positions: jax.Array,  # int32 [T]
    *,
    config: ModelConfig,
    attention_fn: AttentionFn = dense_causal_attention,
    cache: Any = None,
) -> tuple[jax.Array, Any]:
    """Run the decoder over T tokens; returns the final-normed hidden states [T, D] and the cache
    as threaded through every layer's `attention_fn`."""
    x = jnp.take(params["embed"], tokens, axis=0)  # [T, D]
    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)

    def body(carry, xs):
        x, cache = carry
        lp, layer = xs
        x, cache = _layer(x, lp, layer, positions, cache, config=config, attention_fn=attention_fn)
        return (x, cache), None

    (x, cache), _ = jax.lax.scan(body, (x, cache), (params["layers"], layer_ids))
    return rms_norm(x, params["final_norm"], config.rms_norm_eps), cache


def compute_logits(
    params: Params,
    hidden: jax.Array,  # [T, D]
    *,
    config: ModelConfig,
) -> jax.Array:
    """Vocabulary logits [T, V] in float32 (tied embeddings reuse `embed`)."""
    if config.tie_word_embeddings:
        return jnp.einsum("td,vd->tv", hidden, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("td,dv->tv", hidden, params["lm_head"], preferred_element_type=jnp.float32)
