"""The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, Qwen3) as a pure function of params.

Params are a plain nested dict with the layers stacked on a leading L axis, so the decoder runs
as one `lax.scan` (compile time independent of depth) and the tree shards and donates cleanly.
Matmul weights are stored [out, in] (the orientation of HF's nn.Linear), and every projection
is a 2-D dot contracting the weight's last (minor) axis: on XLA:CPU that is 20-45% faster than
[in, out] for the few-row dots of decoding, and even with it for prefill-sized ones
(bench/weight_layout.py).

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D],
                "wqkv": [L, Hkv, G + 2, hd, D],   # per KV head: its G query heads, then k, then v
                "bqkv": [L, Hkv, G + 2, hd],      # only if config.qkv_bias
                "q_norm": [L, hd], "k_norm": [L, hd],  # only if config.qk_norm
                "wo": [L, D, Hkv, G, hd],
                "mlp_norm": [L, D],
                "w_gate_up": [L, 2, F, D],        # gate (index 0) and up (index 1)
                "w_down": [L, D, F]},
     "final_norm": [D],
     "lm_head": [V, D]}                           # absent when tie_word_embeddings

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
        "wqkv": (n, c.num_kv_heads, g + 2, hd, d),
        "wo": (n, d, c.num_kv_heads, g, hd),
        "mlp_norm": (n, d),
        "w_gate_up": (n, 2, f, d),
        "w_down": (n, d, f),
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
        shapes["lm_head"] = (c.vocab_size, d)
    return shapes


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, in] times an [out..., in] weight, as one 2-D dot contracting both last axes: [T, out]
    with the out axes flattened (a free reshape; the multi-axis einsum is slower on XLA:CPU)."""
    return jnp.einsum("ti,oi->to", x, w.reshape(-1, w.shape[-1]))


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
    qkv = _linear(h, lp["wqkv"]).reshape(t, c.num_kv_heads, g + 2, c.head_dim)
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
    attn = attn.astype(x.dtype).reshape(t, c.num_heads * c.head_dim)  # heads grouped by KV head
    x = x + _linear(attn, lp["wo"].reshape(x.shape[1], -1))

    h = rms_norm(x, lp["mlp_norm"], eps)
    # two dots, not one over a merged [2F, D]: tensor parallelism splits F, which merging would mix
    act = jax.nn.silu(_linear(h, lp["w_gate_up"][0])) * _linear(h, lp["w_gate_up"][1])
    x = x + _linear(act, lp["w_down"])
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
    w = params["embed"] if config.tie_word_embeddings else params["lm_head"]  # [V, D]
    return jnp.einsum("td,vd->tv", hidden, w, preferred_element_type=jnp.float32)
