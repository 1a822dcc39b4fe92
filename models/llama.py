"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen3-MoE) as an NNX module over a params tree.

Params are a plain nested dict with the layers stacked on a leading L axis, so the decoder runs
as one `lax.scan` (compile time independent of depth) and the tree shards and donates cleanly.
Matmul weights are stored [out, in] (the orientation of HF's nn.Linear), and every projection
is a 2-D dot contracting the weight's last (minor) axis: on XLA:CPU that is 20-45% faster than
[in, out] for the few-row dots of decoding, and even with it for prefill-sized ones
(measured side by side).

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
engine can substitute its KV-pool write + ragged paged attention without touching the model, and
every matmul to `linear_fn(x, w, index, norm=None, silu_gate=None, residual=None)` over the
stacked weight, so the engine can run decode steps' few-row matmuls in a native CPU kernel that
reads each layer's weight in place, applies the norm or the MLP's activation as it packs x and
adds the skip connection as it stores the product.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layers import apply_rope, dense_causal_attention, rms_norm
from .lora import LoraInputs, lora_delta
from .quant.matmul import QUANTIZED_WEIGHTS, embedding_rows, quantized_matmul, vocab_logits
from .rope import rope_attention_factor, rope_inv_freq_at


class AttentionFn(Protocol):
    """Attention of one layer over the new tokens and whatever ``cache`` holds: the paged
    engine writes k and v into its KV pool and runs ragged paged attention; a dense forward
    uses `dense_causal_attention`."""

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


Params = dict[str, Any]


class RMSNorm(NamedTuple):
    """An RMSNorm for `linear_fn` to apply to x's rows before the product."""

    weight: jax.Array  # [K]
    eps: float


class LinearFn(Protocol):
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
    if c.num_experts:  # Mixtral: a router and E gated MLPs in place of the one
        e = c.num_experts
        del layers["w_gate_up"], layers["w_down"]
        layers["router"] = (n, e, d)
        layers["w_experts_gate_up"] = (n, e, 2, f, d)
        layers["w_experts_down"] = (n, e, d, f)
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


def _matmul_views(layers: dict[str, jax.Array], config: ModelConfig) -> dict[str, jax.Array]:
    """The stacked matmul weights as the [L', out, in] views that ``linear_fn`` receives
    (free reshapes): wqkv [L, Hkv*(G+2)*hd, D], wo [L, D, Hq*hd], w_gate_up [2L, F, D] (gate
    of layer l at 2l, up at 2l + 1), w_down [L, D, F]."""
    n, d, f = config.num_layers, config.hidden_size, config.intermediate_size
    views = {"wqkv": layers["wqkv"].reshape(n, -1, d), "wo": layers["wo"].reshape(n, d, -1)}
    if not config.num_experts:  # experts' weights stay XLA's (_moe_mlp)
        views["w_gate_up"] = layers["w_gate_up"].reshape(2 * n, f, d)
        views["w_down"] = layers["w_down"]
    return views


def map_matmul_weights(
    params: Params, config: ModelConfig, fn: Callable[[jax.Array], jax.Array]
) -> Params:
    """New params with ``fn`` applied to every matmul weight in its ``linear_fn`` view
    ([L', out, in]; the vocabulary projection as [1, V, D], stored as "lm_head" even when
    tied, since the embedding lookup needs the original). For kernels that want their own
    layout of the same shape (kernels.cpu.pack_panels); such params only work with the
    ``linear_fn`` that expects that layout."""
    layers = dict(params["layers"])
    for name, view in _matmul_views(layers, config).items():
        layers[name] = fn(view).reshape(layers[name].shape)
    out = {**params, "layers": layers}
    out["lm_head"] = fn(_vocab_projection(params)[None])[0]
    return out


def streamed_weights(params: Params) -> list[jax.Array]:
    """The arrays every decode step reads in full: each layer's weights and norms and the
    vocabulary projection (not the embedding table, of which a step reads a few rows, unless
    it doubles as the projection)."""
    return [*jax.tree.leaves(params["layers"]), *jax.tree.leaves(_vocab_projection(params))]


def _vocab_projection(params: Params) -> jax.Array:  # [V, D]
    # "lm_head" is absent for tied embeddings unless map_matmul_weights added its own copy
    return params["lm_head"] if "lm_head" in params else params["embed"]


def _layer(
    x: jax.Array,  # [T, D]
    layers: dict[str, jax.Array],  # every layer's params, stacked on a leading L axis
    layer: jax.Array,  # int32 []
    positions: jax.Array,  # int32 [T]
    cache: Any,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn,
    linear_fn: LinearFn,
    lora: LoraInputs | None = None,
    rope_lengths: jax.Array | None = None,  # int32 [T]
) -> tuple[jax.Array, Any]:
    c = config
    t = x.shape[0]
    g = c.queries_per_kv
    eps = c.rms_norm_eps
    inv_freq = rope_inv_freq_at(c, positions, rope_lengths)
    # Matmul weights go to linear_fn whole, so a native kernel can read the layer in place.
    w = _matmul_views(layers, c)

    attn_norm = RMSNorm(layers["attn_norm"][layer], eps)
    qkv = linear_fn(x, w["wqkv"], layer, norm=attn_norm)
    if lora is not None:  # after the base call, on the same input
        qkv = qkv + lora_delta(x, lora, "qkv", layer, norm=attn_norm)
    qkv = qkv.reshape(t, c.num_kv_heads, g + 2, c.head_dim)
    if c.qkv_bias:
        qkv = qkv + layers["bqkv"][layer][None]
    q = qkv[:, :, :g].reshape(t, c.num_heads, c.head_dim)
    k = qkv[:, :, g]  # [T, Hkv, hd]
    v = qkv[:, :, g + 1]
    if c.qk_norm:
        q = rms_norm(q, layers["q_norm"][layer], eps)
        k = rms_norm(k, layers["k_norm"][layer], eps)
    q = apply_rope(q, positions, inv_freq, rope_attention_factor(c))
    k = apply_rope(k, positions, inv_freq, rope_attention_factor(c))

    window = {} if c.sliding_window is None else {"sliding_window": c.sliding_window}
    attn, cache = attention_fn(q, k, v, layer, cache, **window)  # [T, Hq, hd]
    attn = attn.astype(x.dtype).reshape(t, c.num_heads * c.head_dim)  # heads grouped by KV head
    x = linear_fn(attn, w["wo"], layer, residual=x)
    if lora is not None:
        x = x + lora_delta(attn, lora, "o", layer)

    if c.num_experts:  # the experts' dots in their weights' dtype, as without activation_dtype;
        # the engine refuses LoRA for MoE models
        h = rms_norm(x, layers["mlp_norm"][layer], eps).astype(layers["w_experts_down"].dtype)
        return x + _moe_mlp(h, layers, layer, c).astype(x.dtype), cache
    mlp_norm = RMSNorm(layers["mlp_norm"][layer], eps)
    # two dots, not one over a merged [2F, D]: tensor parallelism splits F, which merging would mix
    gate = linear_fn(x, w["w_gate_up"], 2 * layer, norm=mlp_norm)
    up = linear_fn(x, w["w_gate_up"], 2 * layer + 1, norm=mlp_norm)
    if lora is not None:
        gate = gate + lora_delta(x, lora, "gate", layer, norm=mlp_norm)
        up = up + lora_delta(x, lora, "up", layer, norm=mlp_norm)
    x = linear_fn(up, w["w_down"], layer, silu_gate=gate, residual=x)
    if lora is not None:
        x = x + lora_delta(up, lora, "down", layer, silu_gate=gate)
    return x, cache


def _moe_mlp(
    h: jax.Array,  # [T, D], normed
    layers: dict[str, jax.Array],
    layer: jax.Array,  # int32 []
    config: ModelConfig,
) -> jax.Array:  # [T, D]
    """Mixtral's and Qwen3-MoE's sparse MLP: softmax over the router's logits (float32), the
    top k experts (renormalized to sum to 1 if config.norm_topk_prob), their gated SiLU MLPs summed with those weights. Every expert
    runs on every token (weights zero off the top k): exact, and cheap for few experts."""
    logits = jnp.einsum("td,ed->te", h, layers["router"][layer], preferred_element_type=jnp.float32)
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), config.num_experts_per_tok)
    if config.norm_topk_prob:
        top_w = top_w / top_w.sum(axis=-1, keepdims=True)
    top_w = top_w.astype(h.dtype)  # [T, k]
    weights = jnp.einsum(
        "tk,tke->te", top_w, jax.nn.one_hot(top_i, config.num_experts, dtype=h.dtype)
    )
    gate_up = jnp.einsum("td,ecfd->tecf", h, layers["w_experts_gate_up"][layer])  # [T, E, 2, F]
    act = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [T, E, F]
    out = jnp.einsum("tef,edf->ted", act, layers["w_experts_down"][layer])  # [T, E, D]
    return jnp.einsum("te,ted->td", weights, out)


class LlamaForCausalLM(nnx.Module):
    """The Llama family as an NNX module whose state is exactly the params tree above
    (``nnx.to_pure_dict(nnx.state(model))`` has the same paths and shapes as
    `param_shapes`), so loaders, tensor-parallel shardings, Orbax and the CPU weight packing
    work on the state as on any params tree, and the engine's jitted step takes
    ``(graphdef, state)`` with the graph definition static.

    ``lm_head``: whether the state holds its own vocabulary projection (default: unless the
    embeddings are tied; packed params add one even when tied, see `map_matmul_weights`).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: Any = jnp.float32,
        lm_head: bool | None = None,
    ) -> None:
        self.config = config
        shapes = param_shapes(config)
        self.embed = nnx.Param(jnp.zeros(shapes["embed"], dtype))
        self.layers = _StackedLayers(shapes["layers"], dtype)
        self.final_norm = nnx.Param(jnp.ones(shapes["final_norm"], dtype))
        if not config.tie_word_embeddings if lm_head is None else lm_head:
            self.lm_head = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype))

    @classmethod
    def graphdef_for(cls, config: ModelConfig, params: Params) -> nnx.GraphDef:
        """The static graph of a model over ``params`` (no arrays are made)."""
        has_head = "lm_head" in params
        return nnx.graphdef(nnx.eval_shape(lambda: cls(config, lm_head=has_head)))

    @classmethod
    def from_params(cls, config: ModelConfig, params: Params) -> LlamaForCausalLM:
        """The module over ``params`` as they are (arrays are not copied)."""
        return nnx.merge(cls.graphdef_for(config, params), params)

    def params(self) -> Params:
        """The state as a plain params tree."""
        return nnx.to_pure_dict(nnx.state(self))

    def __call__(
        self,
        tokens: jax.Array,  # int32 [T]
        positions: jax.Array,  # int32 [T]
        attention_fn: AttentionFn = dense_causal_attention,
        cache: Any = None,
        *,
        linear_fn: LinearFn | None = None,
        activation_dtype: Any = None,
        lora: LoraInputs | None = None,
        rope_lengths: jax.Array | None = None,  # int32 [T]
    ) -> tuple[jax.Array, Any]:
        """Final-normed hidden states [T, D] and the cache as threaded through every layer's
        ``attention_fn``; ``linear_fn`` does every matmul (None: `linear_xla`).
        ``activation_dtype``: the hidden states' dtype between layers (None: the params'),
        e.g. float32 where a ``linear_fn`` computes bfloat16 weights in float32; ``lora``
        adds each token's adapter term after the matmuls it targets. ``rope_lengths``: each
        token's sequence length once this forward has run, which dynamic RoPE scales by
        (None: one sequence, ``max(positions) + 1``)."""
        config = self.config
        linear_fn = linear_fn or linear_xla
        # a quantized table's rows come out float32: back to the params' dtype
        x = embedding_rows(self.embed.get_value(), tokens).astype(self.final_norm[...].dtype)
        if activation_dtype is not None:
            x = x.astype(activation_dtype)
        layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
        # host arrays can't take a traced index
        layers = {
            k: jax.tree.map(jnp.asarray, v.get_value())
            for k, v in vars(self.layers).items()
            if _is_param(v)
        }

        def body(carry, layer):
            x, cache = carry
            x, cache = _layer(
                x, layers, layer, positions, cache,
                config=config, attention_fn=attention_fn, linear_fn=linear_fn, lora=lora,
                rope_lengths=rope_lengths,
            )  # fmt: skip
            return (x, cache), None

        (x, cache), _ = jax.lax.scan(body, (x, cache), layer_ids)
        return rms_norm(x, self.final_norm[...], config.rms_norm_eps), cache

    def compute_logits(
        self,
        hidden: jax.Array,  # [T, D]
        *,
        linear_fn: LinearFn | None = None,
    ) -> jax.Array:
        """Vocabulary logits [T, V] in float32 (tied embeddings reuse ``embed``)."""
        w = (self.lm_head if hasattr(self, "lm_head") else self.embed).get_value()  # [V, D]
        if linear_fn is not None:
            return linear_fn(hidden, w[None], 0).astype(jnp.float32)
        return vocab_logits(hidden, w)

    # The engine's platform hooks (see jaxpaged.kernels.platform), over the state as params.
    @staticmethod
    def map_matmul_weights(
        params: Params, config: ModelConfig, fn: Callable[[jax.Array], jax.Array]
    ) -> Params:
        return map_matmul_weights(params, config, fn)

    @staticmethod
    def streamed_weights(params: Params) -> list[jax.Array]:
        return streamed_weights(params)


class _StackedLayers(nnx.Module):
    """Every decoder layer's weights, stacked on a leading L axis (one nnx.Param per leaf of
    ``param_shapes(config)["layers"]``), so the decoder is one ``lax.scan`` and a native
    matmul reads layer l of a weight in place."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: Any) -> None:
        for name, shape in shapes.items():
            init = jnp.ones if name.endswith("norm") else jnp.zeros
            setattr(self, name, nnx.Param(init(shape, dtype)))


def _is_param(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def forward(
    params: Params,
    tokens: jax.Array,  # int32 [T]
    positions: jax.Array,  # int32 [T]
    *,
    config: ModelConfig,
    attention_fn: AttentionFn = dense_causal_attention,
    cache: Any = None,
    linear_fn: LinearFn | None = None,
    activation_dtype: Any = None,
) -> tuple[jax.Array, Any]:
    """`LlamaForCausalLM.__call__` over a params tree: the final-normed hidden states [T, D]
    and the cache."""
    model = LlamaForCausalLM.from_params(config, params)
    return model(
        tokens, positions, attention_fn, cache, linear_fn=linear_fn,
        activation_dtype=activation_dtype,
    )  # fmt: skip


def compute_logits(
    params: Params,
    hidden: jax.Array,  # [T, D]
    *,
    config: ModelConfig,
    linear_fn: LinearFn | None = None,
) -> jax.Array:
    """`LlamaForCausalLM.compute_logits` over a params tree: float32 logits [T, V]."""
    model = LlamaForCausalLM.from_params(config, params)
    return model.compute_logits(hidden, linear_fn=linear_fn)
