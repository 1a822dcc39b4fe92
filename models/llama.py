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
engine can substitute its KV-pool write + ragged paged attention without touching the model.
The layer is a composition of the shared layers of models/blocks.py over its declared linears
(``LINEARS``): a pre-norm q/k/v projection, a residual-added output projection and the gated
SiLU MLP. They run every matmul through the platform's ``linear_fn`` over the stacked weight
(the CPU's native kernel reads each layer's weight in place and fuses the norm, the SiLU gate
and the residual add); the layer itself says only what it computes.

The module is also the family's declaration (``FAMILY``, models/family.py): its config.json
parsing, its safetensors and GGUF weight names, its linears (whose partition metadata is
the tensor-parallel split) and the features it refuses. Granite (models/granite.py) is declared on this layer, through the four
``ModelConfig`` scalars it reads (embedding, residual and attention multipliers, logits
scaling).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .blocks import LayerLinears, gated_silu_mlp, normed_projection, residual_projection
from .config import ModelConfig
from .family import (
    GgufLayout,
    LoraLayout,
    LoraModule,
    LoraPiece,
    LoraSite,
    ModelFamily,
    gguf_layout_of,
)
from .layers import StackedParams, apply_rope, dense_causal_attention, param, rms_norm
from .linear import linear_xla
from .llama_layout import (
    GGUF_LAYER_TENSORS,
    GGUF_NORMS,
    LAYER_SPLITS,
    LINEARS,
    MODEL_TYPES,
    gguf_config,
    load_host_params,
    parse_config,
)
from .lora_term import LoraInputs, lora_delta, lora_expert_delta
from .quant.matmul import embedding_rows, vocab_logits
from .rope import rope_attention_factor, rope_inv_freq_at
from .types import AttentionFn, LinearFn, Params, RMSNorm


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
    # the linears of this layer: matmul weights go to linear_fn whole, read in place
    lin = LayerLinears.of(layers, LINEARS, layer, linear_fn, lora)

    qkv = normed_projection(lin, "wqkv", x, RMSNorm(layers["attn_norm"][layer], eps))
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

    options = {} if c.sliding_window is None else {"sliding_window": c.sliding_window}
    if c.attention_multiplier is not None:  # Granite's attention scale
        options["sm_scale"] = c.attention_multiplier
    attn, cache = attention_fn(q, k, v, layer, cache, **options)  # [T, Hq, hd]
    attn = attn.astype(x.dtype).reshape(t, c.num_heads * c.head_dim)  # heads grouped by KV head
    x = residual_projection(lin, "wo", x, attn, multiplier=c.residual_multiplier)

    if c.num_experts:  # the experts' dots in their weights' dtype, as without activation_dtype
        h = rms_norm(x, layers["mlp_norm"][layer], eps).astype(layers["w_experts_down"].dtype)
        out = _moe_mlp(h, layers, layer, c, lora).astype(x.dtype)
        return x + out * jnp.asarray(c.residual_multiplier, x.dtype), cache
    mlp_norm = RMSNorm(layers["mlp_norm"][layer], eps)
    x = gated_silu_mlp(lin, "w_gate_up", "w_down", x, mlp_norm, multiplier=c.residual_multiplier)
    return x, cache


def _moe_mlp(
    h: jax.Array,  # [T, D], normed
    layers: dict[str, jax.Array],
    layer: jax.Array,  # int32 []
    config: ModelConfig,
    lora: LoraInputs | None = None,
) -> jax.Array:  # [T, D]
    """Mixtral's and Qwen3-MoE's sparse MLP: softmax over the router's logits (float32), the
    top k experts (renormalized to sum to 1 if config.norm_topk_prob), their gated SiLU MLPs summed with those weights. Every expert
    runs on every token (weights zero off the top k): exact, and cheap for few experts.
    ``lora`` adds the adapters' router and experts terms after their products."""
    logits = jnp.einsum("td,ed->te", h, layers["router"][layer], preferred_element_type=jnp.float32)
    if lora is not None:
        logits = logits + lora_delta(h, lora, "router", layer).astype(jnp.float32)
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), config.num_experts_per_tok)
    if config.norm_topk_prob:
        top_w = top_w / top_w.sum(axis=-1, keepdims=True)
    top_w = top_w.astype(h.dtype)  # [T, k]
    weights = jnp.einsum(
        "tk,tke->te", top_w, jax.nn.one_hot(top_i, config.num_experts, dtype=h.dtype)
    )
    gate_up = jnp.einsum("td,ecfd->tecf", h, layers["w_experts_gate_up"][layer])  # [T, E, 2, F]
    if lora is not None:  # rows gate, then up, as the fused gate_up_proj
        e = config.num_experts
        gate_up = gate_up + lora_expert_delta(h, lora, "experts_gate_up", layer, e).reshape(
            gate_up.shape
        )
    act = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [T, E, F]
    out = jnp.einsum("tef,edf->ted", act, layers["w_experts_down"][layer])  # [T, E, D]
    if lora is not None:
        out = out + lora_expert_delta(act, lora, "experts_down", layer, config.num_experts)
    return jnp.einsum("te,ted->td", weights, out)


class LlamaForCausalLM(nnx.Module):
    """The Llama family as an NNX module whose state is exactly the params tree above
    (``nnx.to_pure_dict(nnx.state(model))`` has the same paths and shapes as
    `param_shapes`), so loaders, tensor-parallel shardings, Orbax and the CPU weight packing
    work on the state as on any params tree, and the engine's jitted step takes
    ``(graphdef, state)`` with the graph definition static.

    ``lm_head``: whether the state holds its own vocabulary projection (default: unless the
    embeddings are tied; packed params add one even when tied, see
    `linear.map_matmul_weights`).
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
        # the vocabulary split over devices (parallel.py replicates it where N does not
        # divide V)
        self.embed = param(jnp.zeros(shapes["embed"], dtype), split=0)
        norms = [name for name in shapes["layers"] if name.endswith("norm")]
        self.layers = StackedParams(shapes["layers"], dtype, ones=norms, splits=LAYER_SPLITS)
        self.final_norm = nnx.Param(jnp.ones(shapes["final_norm"], dtype))
        if not config.tie_word_embeddings if lm_head is None else lm_head:
            shape = (config.vocab_size, config.hidden_size)
            self.lm_head = param(jnp.zeros(shape, dtype), split=0)

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
        aux_layers: tuple[int, ...] = (),
        image_embeds: tuple[jax.Array, jax.Array] | None = None,  # ([T, D], bool [T])
    ) -> tuple[jax.Array, Any] | tuple[jax.Array, Any, jax.Array]:
        """Final-normed hidden states [T, D] and the cache as threaded through every layer's
        ``attention_fn``; ``linear_fn`` does every matmul (None: `linear_xla`).
        ``aux_layers`` (an EAGLE-3 head's, models/eagle3.py): also the residual stream
        entering each of those layers, concatenated in their order, [T, len * D], third.
        ``activation_dtype``: the hidden states' dtype between layers (None: the params'),
        e.g. float32 where a ``linear_fn`` computes bfloat16 weights in float32; ``lora``
        adds each token's adapter term after the matmuls it targets. ``rope_lengths``: each
        token's sequence length once this forward has run, which dynamic RoPE scales by
        (None: one sequence, ``max(positions) + 1``). ``image_embeds``: rows that replace
        the masked tokens' embeddings (image placeholders, models/qwen2_vl.py); positions
        may be per rotary pair, [T, head_dim / 2] (M-RoPE)."""
        config = self.config
        linear_fn = linear_fn or linear_xla
        # a quantized table's rows come out float32: back to the params' dtype
        x = embedding_rows(self.embed.get_value(), tokens).astype(self.final_norm[...].dtype)
        if config.embedding_multiplier != 1.0:  # Granite
            x = x * jnp.asarray(config.embedding_multiplier, x.dtype)
        if image_embeds is not None:
            x = jnp.where(image_embeds[1][:, None], image_embeds[0].astype(x.dtype), x)
        if activation_dtype is not None:
            x = x.astype(activation_dtype)
        layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
        layers = self.layers.arrays()

        unique = sorted(set(aux_layers))
        n_aux = len(unique)
        wanted = jnp.asarray(unique or (-1,), jnp.int32)
        # slot n_aux takes the layers nobody asked for: one in-place write per layer
        aux = jnp.zeros((n_aux + 1, *x.shape), x.dtype) if n_aux else None

        def body(carry, layer):
            x, cache, aux = carry
            if aux is not None:
                hit = wanted == layer
                slot = jnp.where(jnp.any(hit), jnp.argmax(hit), n_aux)
                aux = jax.lax.dynamic_update_index_in_dim(aux, x, slot, 0)
            x, cache = _layer(
                x, layers, layer, positions, cache,
                config=config, attention_fn=attention_fn, linear_fn=linear_fn, lora=lora,
                rope_lengths=rope_lengths,
            )  # fmt: skip
            return (x, cache, aux), None

        (x, cache, aux), _ = jax.lax.scan(body, (x, cache, aux), layer_ids)
        out = rms_norm(x, self.final_norm[...], config.rms_norm_eps)
        if aux is None:
            return out, cache
        return out, cache, jnp.concatenate([aux[unique.index(i)] for i in aux_layers], axis=-1)

    def compute_logits(
        self,
        hidden: jax.Array,  # [T, D]
        *,
        linear_fn: LinearFn | None = None,
    ) -> jax.Array:
        """Vocabulary logits [T, V] in float32 (tied embeddings reuse ``embed``), divided
        by ``config.logits_scaling``."""
        w = (self.lm_head if hasattr(self, "lm_head") else self.embed).get_value()  # [V, D]
        if linear_fn is not None:
            logits = linear_fn(hidden, w[None], 0).astype(jnp.float32)
        else:
            logits = vocab_logits(hidden, w)
        scaling = self.config.logits_scaling  # Granite divides the logits by it
        return logits if scaling == 1.0 else logits / scaling


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


# ------------------------------------------------------------------- config


def lora_layout(config: ModelConfig) -> LoraLayout:
    """The LoRA sites of `_layer` and the PEFT modules that fill them (models/lora.py):
    qkv (q_proj, k_proj, v_proj as three rank blocks, rows in the fused wqkv order; Phi-3's
    fused qkv_proj as one), o (o_proj), gate, up and down (gate_proj, up_proj, down_proj;
    Phi-3's gate_up_proj fills gate and up). A mixture-of-experts model has the attention
    sites, the router's and the experts' (parameters PEFT targets with
    ``target_parameters``: mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj)."""
    c = config
    d, f, hd, hkv, g = (
        c.hidden_size,
        c.intermediate_size,
        c.head_dim,
        c.num_kv_heads,
        c.queries_per_kv,
    )
    q_out = c.num_heads * hd
    fused = np.arange(hkv * (g + 2) * hd).reshape(hkv, g + 2, hd)  # wqkv's output rows
    q_rows, k_rows, v_rows = (fused[:, :g].reshape(-1), fused[:, g].reshape(-1),
                              fused[:, g + 1].reshape(-1))  # fmt: skip
    sites = {"qkv": LoraSite(d, fused.size, parts=3), "o": LoraSite(q_out, d)}
    modules = {"self_attn.o_proj": LoraModule(q_out, d, (LoraPiece("o"),))}
    if c.fused_projections:  # Phi-3's qkv_proj: one rank block
        qkv_rows = np.concatenate([q_rows, k_rows, v_rows])
        modules["self_attn.qkv_proj"] = LoraModule(
            d, qkv_rows.size, (LoraPiece("qkv", 0, qkv_rows),)
        )
    else:
        for part, (name, rows) in enumerate(
            (("q_proj", q_rows), ("k_proj", k_rows), ("v_proj", v_rows))
        ):
            modules[f"self_attn.{name}"] = LoraModule(d, rows.size, (LoraPiece("qkv", part, rows),))
    parameters = {}
    if c.num_experts:  # the router and the experts, as transformers 5 holds them
        e = c.num_experts
        sites |= {
            "router": LoraSite(d, e),
            "experts_gate_up": LoraSite(d, 2 * f, experts=e),
            "experts_down": LoraSite(f, d, experts=e),
        }
        parameters = {
            "mlp.gate.weight": LoraModule(d, e, (LoraPiece("router"),)),
            "mlp.experts.gate_up_proj": LoraModule(
                d, 2 * f, (LoraPiece("experts_gate_up"),), experts=e
            ),
            "mlp.experts.down_proj": LoraModule(f, d, (LoraPiece("experts_down"),), experts=e),
        }
    else:
        sites |= {"gate": LoraSite(d, f), "up": LoraSite(d, f), "down": LoraSite(f, d)}
        modules["mlp.down_proj"] = LoraModule(f, d, (LoraPiece("down"),))
        if c.fused_projections:  # Phi-3's gate_up_proj fills gate and up
            first, second = np.arange(2 * f), np.arange(2 * f) - f  # gate rows, then up rows
            gate = LoraPiece("gate", 0, np.where(first < f, first, -1))
            modules["mlp.gate_up_proj"] = LoraModule(d, 2 * f, (gate, LoraPiece("up", 0, second)))
        else:
            modules["mlp.gate_proj"] = LoraModule(d, f, (LoraPiece("gate"),))
            modules["mlp.up_proj"] = LoraModule(d, f, (LoraPiece("up"),))
    return LoraLayout(
        layer_prefix="model.layers.{}.", sites=sites, modules=modules, parameters=parameters
    )


GGUF_LAYOUTS: tuple[GgufLayout, ...] = (
    GgufLayout(
        architecture="llama",
        model_type="llama",
        hf_architecture="LlamaForCausalLM",
        layer_tensors=GGUF_LAYER_TENSORS,
        permuted_qk=True,  # llama.cpp permutes q/k rows for this architecture only
        layer_norms=GGUF_NORMS,
        config_fields=gguf_config,
    ),
    GgufLayout(
        architecture="qwen2",
        model_type="qwen2",
        hf_architecture="Qwen2ForCausalLM",
        layer_tensors=GGUF_LAYER_TENSORS,
        layer_norms=GGUF_NORMS,
    ),
)


def _refused(config: ModelConfig) -> dict[str, str]:
    refused = {}
    if config.num_experts:
        refused["gguf_quantized"] = "a mixture-of-experts GGUF import is read as floats"
    if config.fused_projections:
        refused["prequantized"] = (
            "its fused qkv_proj and gate_up_proj are read as floats only; load its float "
            "checkpoint instead"
        )
    if gguf_layout_of(GGUF_LAYOUTS, config) is None or config.qk_norm:
        refused.setdefault("gguf_quantized", "no GGUF layout of this model type is read quantized")
    return refused


FAMILY = ModelFamily(
    name="llama",
    architectures=(
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    ),  # fmt: skip
    model_types=MODEL_TYPES,
    parse_config=parse_config,
    module=LlamaForCausalLM,
    param_shapes=param_shapes,
    load_host_params=load_host_params,
    linears=LINEARS,
    gguf=GGUF_LAYOUTS,
    refused=_refused,
    lora=lora_layout,
)
