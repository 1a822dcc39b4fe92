"""EAGLE-3 draft heads in the published checkpoint layout (SafeAILab/EAGLE, SpecForge, vLLM's
``speculators`` format), and their forward as plain functions over a params dict.

A head is one Llama decoder layer (``midlayer``) whose attention reads the concatenation of
two normed inputs: the embedding of a token and a hidden state. At the first draft position
that hidden state is ``fc`` ([H, 3 * H_target]) over the target's residual stream entering
three of its layers (low, mid, high: ``eagle_aux_hidden_state_layer_ids``, vLLM's default
``(2, L // 2, L - 3)``); at later positions it is the head's own pre-norm output. The head
ends in its own ``norm`` and an ``lm_head`` over a reduced draft vocabulary; ``d2t`` maps a
draft id to its target id (``target = draft + d2t[draft]``). Without ``embed_tokens`` the
head shares the target's embedding.

Checkpoint tensors (``model.`` prefixes and ``layers.0.`` for ``midlayer.`` are accepted):

    fc.weight [H, 3 * H_target]             midlayer.hidden_norm.weight [H]
    midlayer.input_layernorm.weight [H]     midlayer.post_attention_layernorm.weight [H]
    midlayer.self_attn.{q,k,v}_proj.weight [heads * hd, 2 * H]  (+ .bias if attention_bias)
    midlayer.self_attn.o_proj.weight [H, Hq * hd]
    midlayer.mlp.{gate,up}_proj.weight [F, H], midlayer.mlp.down_proj.weight [H, F]
    norm.weight [H]    lm_head.weight [V_draft, H]    d2t [V_draft] (int)    t2d (unused)
    embed_tokens.weight [V, H] (optional)

MTP heads that ship inside a model (DeepSeek-V3, Qwen3-Next) have the same shape of work, a
layer over (embedding, hidden state) with the target's KV pool growing by its layers, and
would load beside this module as another head layout.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .layers import apply_rope, rms_norm
from .llama_layout import config_fields
from .quant.matmul import embedding_rows
from .rope import rope_attention_factor, rope_inv_freq_at
from .types import AttentionFn

__all__ = [
    "Eagle3Config",
    "default_aux_layers",
    "draft_ids",
    "head_forward",
    "load_eagle3",
    "parse_eagle3_config",
]

# checkpoint name (after the prefixes are normalised) -> params leaf
_NAMES = {
    "fc.weight": "fc",
    "midlayer.input_layernorm.weight": "input_norm",
    "midlayer.hidden_norm.weight": "hidden_norm",
    "midlayer.post_attention_layernorm.weight": "post_attn_norm",
    "midlayer.self_attn.q_proj.weight": "wq",
    "midlayer.self_attn.k_proj.weight": "wk",
    "midlayer.self_attn.v_proj.weight": "wv",
    "midlayer.self_attn.q_proj.bias": "bq",
    "midlayer.self_attn.k_proj.bias": "bk",
    "midlayer.self_attn.v_proj.bias": "bv",
    "midlayer.self_attn.o_proj.weight": "wo",
    "midlayer.mlp.gate_proj.weight": "w_gate",
    "midlayer.mlp.up_proj.weight": "w_up",
    "midlayer.mlp.down_proj.weight": "w_down",
    "norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "d2t": "d2t",
    "embed_tokens.weight": "embed",
}
_OPTIONAL = ("bq", "bk", "bv", "d2t", "embed")
_IGNORED = ("t2d",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    """A head's settings: ``layer`` is its decoder layer as a one-layer Llama config (hidden
    size, heads, RoPE, norm epsilon; ``vocab_size`` the target's)."""

    layer: ModelConfig
    target_hidden_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None = None  # None: default_aux_layers of the target
    norm_before_residual: bool = False
    own_embeddings: bool = False  # the checkpoint has embed_tokens (else the target's)

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        ids = self.aux_layer_ids or default_aux_layers(num_target_layers)
        bad = [i for i in ids if not 0 <= i < num_target_layers]
        if len(ids) != 3 or bad:
            raise ValueError(
                f"speculative_config: EAGLE-3 reads the residual stream entering 3 target "
                f"layers of 0..{num_target_layers - 1}, got eagle_aux_hidden_state_layer_ids "
                f"{list(ids)} (set them in the head's config.json)"
            )
        return tuple(ids)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice: the residual stream entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def parse_eagle3_config(d: Mapping[str, Any]) -> Eagle3Config:
    """From a head's config.json (EAGLE / SpecForge layout, or speculators' with a
    ``transformer_layer_config``); ValueError naming what this engine does not run."""
    layer = dict(d.get("transformer_layer_config") or d)
    eagle = d.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ValueError(
            "speculative_config: an EAGLE head without aux hidden states (use_aux_hidden_state"
            " false: EAGLE-1/2 style) is not supported; method 'eagle3' needs an EAGLE-3 head"
        )
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"speculative_config: EAGLE-3 heads of {layer['num_hidden_layers']} layers are not "
            "supported (one midlayer)"
        )
    layer.update(model_type="llama", num_hidden_layers=1)
    fields = config_fields(layer)
    ids = (
        d.get("eagle_aux_hidden_state_layer_ids")
        or eagle.get("eagle_aux_hidden_state_layer_ids")
        or layer.get("eagle_aux_hidden_state_layer_ids")
    )
    hidden = fields["hidden_size"]
    return Eagle3Config(
        layer=ModelConfig(**fields),
        target_hidden_size=int(
            d.get("target_hidden_size") or layer.get("target_hidden_size") or hidden
        ),  # fmt: skip
        draft_vocab_size=int(
            d.get("draft_vocab_size") or layer.get("draft_vocab_size") or fields["vocab_size"]
        ),
        aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
        norm_before_residual=bool(d.get("norm_before_residual", False)),
    )


def _leaf_name(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def load_eagle3(path: str) -> tuple[Eagle3Config, dict[str, np.ndarray]]:
    """A head folder's config and host params (float32 weights, int32 ``d2t``). ValueError
    naming a missing or misshapen tensor."""
    from safetensors.numpy import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"speculative_config: {path!r} has no config.json (an EAGLE-3 head)")
    with open(cfg_path) as f:
        config = parse_eagle3_config(json.load(f))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"speculative_config: {path!r} has no .safetensors weights")
    params: dict[str, np.ndarray] = {}
    for file in files:
        for name, value in load_file(file).items():
            name = _leaf_name(name)
            if name in _IGNORED:
                continue
            leaf = _NAMES.get(name)
            if leaf is None:
                raise ValueError(f"speculative_config: unexpected EAGLE-3 tensor {name!r}")
            if leaf == "d2t":
                params[leaf] = value.astype(np.int32)
            else:
                params[leaf] = value.astype(np.float32)
    config = dataclasses.replace(config, own_embeddings="embed" in params)
    _check_shapes(config, params)
    return config, params


def param_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """The shape of every params leaf (``bq``/``bk``/``bv`` only with attention bias)."""
    c = config.layer
    h, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    shapes = {
        "fc": (h, 3 * config.target_hidden_size),
        "input_norm": (h,),
        "hidden_norm": (h,),
        "post_attn_norm": (h,),
        "wq": (q, 2 * h),
        "wk": (kv, 2 * h),
        "wv": (kv, 2 * h),
        "wo": (h, q),
        "w_gate": (f, h),
        "w_up": (f, h),
        "w_down": (h, f),
        "norm": (h,),
        "lm_head": (config.draft_vocab_size, h),
        "d2t": (config.draft_vocab_size,),
    }
    if c.qkv_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if config.own_embeddings:
        shapes["embed"] = (c.vocab_size, h)
    return shapes


def _check_shapes(config: Eagle3Config, params: Mapping[str, np.ndarray]) -> None:
    want = param_shapes(config)
    for leaf, shape in want.items():
        if leaf not in params:
            if leaf == "d2t" and config.draft_vocab_size == config.layer.vocab_size:
                continue  # the full vocabulary: draft ids are target ids
            raise ValueError(f"speculative_config: the EAGLE-3 head has no {leaf!r} tensor")
        if tuple(params[leaf].shape) != shape:
            raise ValueError(
                f"speculative_config: EAGLE-3 tensor {leaf!r} has shape "
                f"{tuple(params[leaf].shape)}, expected {shape}"
            )
    extra = set(params) - set(want)
    if extra:
        raise ValueError(f"speculative_config: unexpected EAGLE-3 tensors {sorted(extra)}")


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:  # [T, K] x [N, K] -> [T, N]
    return jnp.dot(x, w.astype(x.dtype).T, preferred_element_type=jnp.float32).astype(x.dtype)


def embed(
    params: Mapping[str, jax.Array],
    target_embed: jax.Array,  # [V, H] the target's table (maybe quantized)
    ids: jax.Array,  # int32 [T] target ids
    dtype: Any,  # noqa: ANN401
) -> jax.Array:  # [T, H]
    """The token embeddings the head reads: its own table, else the target's."""
    table = params["embed"] if "embed" in params else target_embed
    return embedding_rows(table, ids).astype(dtype)


def combine_aux(
    params: Mapping[str, jax.Array],
    aux: jax.Array,  # [T, 3 * H_target] the target's low, mid, high residual streams
) -> jax.Array:  # [T, H]
    """``fc`` over the target's three hidden states: the head's first hidden input."""
    return _dot(aux, params["fc"])


def head_forward(
    params: Mapping[str, jax.Array],
    config: Eagle3Config,
    embeds: jax.Array,  # [T, H] embedding of the token after each position
    hidden: jax.Array,  # [T, H] combine_aux's output, or the head's own pre-norm output
    positions: jax.Array,  # int32 [T]
    attention_fn: AttentionFn,
    cache: Any,  # noqa: ANN401
    *,
    layer_index: int,
) -> tuple[jax.Array, jax.Array, Any]:  # normed [T, H], pre-norm [T, H], cache
    """The midlayer and the final norm: the normed output gives the draft's logits
    (:func:`draft_ids`), the pre-norm output is the next position's ``hidden``. Its K/V go
    through ``attention_fn`` as layer ``layer_index`` of the cache."""
    c = config.layer
    t, eps = embeds.shape[0], c.rms_norm_eps
    e = rms_norm(embeds, params["input_norm"], eps)
    if config.norm_before_residual:
        h = rms_norm(hidden, params["hidden_norm"], eps)
        residual = h
    else:
        residual, h = hidden, rms_norm(hidden, params["hidden_norm"], eps)
    x = jnp.concatenate([e, h], axis=-1)  # [T, 2H]
    q, k, v = _dot(x, params["wq"]), _dot(x, params["wk"]), _dot(x, params["wv"])
    if c.qkv_bias:
        q, k, v = q + params["bq"], k + params["bk"], v + params["bv"]
    q = q.reshape(t, c.num_heads, c.head_dim)
    k = k.reshape(t, c.num_kv_heads, c.head_dim)
    v = v.reshape(t, c.num_kv_heads, c.head_dim)
    inv_freq = rope_inv_freq_at(c, positions, None)
    q = apply_rope(q, positions, inv_freq, rope_attention_factor(c))
    k = apply_rope(k, positions, inv_freq, rope_attention_factor(c))
    attn, cache = attention_fn(q, k, v, layer_index, cache)  # [T, Hq, hd]
    attn = attn.astype(x.dtype).reshape(t, c.num_heads * c.head_dim)
    residual = residual + _dot(attn, params["wo"])
    h = rms_norm(residual, params["post_attn_norm"], eps)
    mlp = _dot(jax.nn.silu(_dot(h, params["w_gate"])) * _dot(h, params["w_up"]), params["w_down"])
    residual = residual + mlp
    return rms_norm(residual, params["norm"], eps), residual, cache


def draft_ids(
    params: Mapping[str, jax.Array],
    normed: jax.Array,  # [S, H]
) -> jax.Array:  # int32 [S] target ids
    """The greedy draft: argmax over the draft vocabulary, mapped to the target's ids."""
    logits = jnp.dot(normed, params["lm_head"].astype(normed.dtype).T,
                     preferred_element_type=jnp.float32)  # fmt: skip
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if "d2t" in params:
        best = best + params["d2t"][best]
    return best
