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

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .blocks import LayerLinears, gated_silu_mlp, normed_projection, residual_projection
from .config import ModelConfig, RopeScaling
from .family import (
    GgufLayout,
    GgufMetadata,
    Linear,
    LoraLayout,
    LoraModule,
    LoraPiece,
    LoraSite,
    ModelFamily,
    linear_splits,
)
from .layers import StackedParams, apply_rope, dense_causal_attention, param, rms_norm
from .linear import linear_xla
from .lora_term import LoraInputs, lora_delta, lora_expert_delta
from .quant.matmul import embedding_rows, vocab_logits
from .rope import rope_attention_factor, rope_inv_freq_at
from .types import AttentionFn, LinearFn, Params, RMSNorm, TensorReader


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

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe")
# MoE families (Qwen3-MoE's count is num_experts, saved by transformers 5 as num_local_experts)
_MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")


def _check_qwen3_moe(d: Mapping) -> None:
    """ValueError naming a Qwen3-MoE option jaxpaged does not run: dense MLP layers among
    the sparse ones."""
    if d.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"unsupported qwen3_moe option decoder_sparse_step={d['decoder_sparse_step']} "
            "(dense MLP layers between the sparse ones); jaxpaged runs 1"
        )
    if d.get("mlp_only_layers"):
        raise ValueError(
            f"unsupported qwen3_moe option mlp_only_layers={list(d['mlp_only_layers'])} "
            "(dense MLP layers); jaxpaged runs []"
        )


def config_fields(d: Mapping) -> dict[str, Any]:
    """ModelConfig fields of a Llama-family config.json, transformers 4 (`rope_theta`,
    `rope_scaling`) or 5 (`rope_parameters`); ValueError naming an option jaxpaged does not
    run. Families built on this layout (models/granite.py) start from these fields."""
    model_type = d.get("model_type")
    num_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "original_max_position_embeddings" in d:  # Phi-3 keeps it beside rope_scaling
        rope = {
            "original_max_position_embeddings": d["original_max_position_embeddings"],
            **rope,
        }
    rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    max_pos = d.get("max_position_embeddings", 2048)
    windowed = ("mistral", "phi3", "mixtral")
    window = d.get("sliding_window") if model_type in windowed else None
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported {model_type} option partial_rotary_factor != 1")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and d.get("use_sliding_window"):
        raise ValueError(
            f"unsupported {model_type} option use_sliding_window=True (sliding window "
            "attention on the layers from max_window_layers on)"
        )
    if model_type == "qwen3_moe":
        _check_qwen3_moe(d)
    scaling = RopeScaling.from_hf_dict(rope, max_pos)
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d[
            "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
        ],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or hidden // num_heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=int(window) if window else None,
        num_experts=int(d.get("num_local_experts") or d.get("num_experts") or 0)
        if model_type in _MOE_MODEL_TYPES
        else 0,
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        # Mixtral always renormalizes; Qwen3-MoE as its config says (transformers: False)
        norm_topk_prob=model_type == "mixtral" or bool(d.get("norm_topk_prob", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def parse_config(d: Mapping) -> ModelConfig:
    return ModelConfig(**config_fields(d))


# ------------------------------------------------------------------- loading


def hf_layer_tensors(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """HF name -> expected shape of layer i's tensors."""
    c = config
    p = f"model.layers.{i}."
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    names = {
        p + "input_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (c.num_heads * hd, d),
        p + "self_attn.k_proj.weight": (c.num_kv_heads * hd, d),
        p + "self_attn.v_proj.weight": (c.num_kv_heads * hd, d),
        p + "self_attn.o_proj.weight": (d, c.num_heads * hd),
        p + "post_attention_layernorm.weight": (d,),
        p + "mlp.gate_proj.weight": (f, d),
        p + "mlp.up_proj.weight": (f, d),
        p + "mlp.down_proj.weight": (d, f),
    }
    if c.num_experts:  # Mixtral: a router and E experts (w1 gate, w3 up, w2 down)
        del names[p + "mlp.gate_proj.weight"], names[p + "mlp.up_proj.weight"]
        del names[p + "mlp.down_proj.weight"]
        moe, (gate, up, down) = _moe_names(c)
        names[p + moe + "gate.weight"] = (c.num_experts, d)
        for e in range(c.num_experts):
            names[p + moe + f"experts.{e}.{gate}.weight"] = (f, d)
            names[p + moe + f"experts.{e}.{up}.weight"] = (f, d)
            names[p + moe + f"experts.{e}.{down}.weight"] = (d, f)
    if c.model_type == "phi3":  # q, k, v fused in one projection; gate and up in another
        for name in ("q_proj", "k_proj", "v_proj"):
            del names[p + f"self_attn.{name}.weight"]
        del names[p + "mlp.gate_proj.weight"], names[p + "mlp.up_proj.weight"]
        names[p + "self_attn.qkv_proj.weight"] = ((c.num_heads + 2 * c.num_kv_heads) * hd, d)
        names[p + "mlp.gate_up_proj.weight"] = (2 * f, d)
    if c.qkv_bias:
        names[p + "self_attn.q_proj.bias"] = (c.num_heads * hd,)
        names[p + "self_attn.k_proj.bias"] = (c.num_kv_heads * hd,)
        names[p + "self_attn.v_proj.bias"] = (c.num_kv_heads * hd,)
    if c.qk_norm:
        names[p + "self_attn.q_norm.weight"] = (hd,)
        names[p + "self_attn.k_norm.weight"] = (hd,)
    return names


def _moe_names(config: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    """The sparse MLP's module prefix in a layer and its experts' gate, up and down names."""
    if config.model_type == "mixtral":
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


def _fill_layer(out: dict[str, Any], i: int, read: TensorReader, config: ModelConfig) -> None:
    """Write layer i of the stacked, fused host arrays from its HF tensors."""
    c = config
    p = f"model.layers.{i}."
    shapes = hf_layer_tensors(c, i)
    g, hkv, hd, d = c.queries_per_kv, c.num_kv_heads, c.head_dim, c.hidden_size
    r = lambda n: read(p + n, shapes[p + n])

    out["attn_norm"][i] = r("input_layernorm.weight")
    out["mlp_norm"][i] = r("post_attention_layernorm.weight")
    if c.model_type == "phi3":
        qkv = r("self_attn.qkv_proj.weight")  # rows: q heads, then k heads, then v heads
        q_rows, kv_rows = c.num_heads * hd, hkv * hd
        wq, wk, wv = np.split(qkv, [q_rows, q_rows + kv_rows])
        wg, wu = np.split(r("mlp.gate_up_proj.weight"), 2)  # gate rows, then up rows
    else:
        wq, wk, wv = (r(f"self_attn.{n}_proj.weight") for n in "qkv")
    wqkv = out["wqkv"][i]  # [Hkv, G + 2, hd, D]
    wqkv[:, :g] = wq.reshape(hkv, g, hd, d)
    wqkv[:, g] = wk.reshape(hkv, hd, d)
    wqkv[:, g + 1] = wv.reshape(hkv, hd, d)
    if c.qkv_bias:
        bqkv = out["bqkv"][i]  # [Hkv, G + 2, hd]
        bqkv[:, :g] = r("self_attn.q_proj.bias").reshape(hkv, g, hd)
        bqkv[:, g] = r("self_attn.k_proj.bias").reshape(hkv, hd)
        bqkv[:, g + 1] = r("self_attn.v_proj.bias").reshape(hkv, hd)
    if c.qk_norm:
        out["q_norm"][i] = r("self_attn.q_norm.weight")
        out["k_norm"][i] = r("self_attn.k_norm.weight")
    out["wo"][i] = r("self_attn.o_proj.weight").reshape(d, hkv, g, hd)
    if c.num_experts:
        moe, (gate, up, down) = _moe_names(c)
        out["router"][i] = r(moe + "gate.weight")
        for e in range(c.num_experts):
            expert = f"{moe}experts.{e}."
            out["w_experts_gate_up"][i, e, 0] = r(expert + gate + ".weight")
            out["w_experts_gate_up"][i, e, 1] = r(expert + up + ".weight")
            out["w_experts_down"][i, e] = r(expert + down + ".weight")
        return
    if c.model_type != "phi3":
        wg, wu = r("mlp.gate_proj.weight"), r("mlp.up_proj.weight")
    out["w_gate_up"][i, 0] = wg
    out["w_gate_up"][i, 1] = wu
    out["w_down"][i] = r("mlp.down_proj.weight")


def load_host_params(
    read: TensorReader, config: ModelConfig, layers: dict[str, Any]
) -> dict[str, Any]:
    """The params tree from HF tensors: ``layers`` (the stacked buffers of
    ``param_shapes(config)["layers"]``, float or a pre-quantized checkpoint's) filled in
    place, the embedding, final norm and vocabulary projection read."""
    for i in range(config.num_layers):
        _fill_layer(layers, i, read, config)
    d, v = config.hidden_size, config.vocab_size
    host: dict[str, Any] = {
        "embed": read("model.embed_tokens.weight", (v, d)),
        "layers": layers,
        "final_norm": read("model.norm.weight", (d,)),
    }
    if not config.tie_word_embeddings:
        host["lm_head"] = read("lm_head.weight", (v, d))
    return host


# ------------------------------------------------------------------- family

# The decoder layer's linears (models/linear.py), each with its Megatron split over the
# params layout above: q/k/v (column-parallel) and the output projection (row-parallel) by
# KV heads, the MLP by F; its pre-quantized checkpoint modules and its LoRA sites
# (`lora_layout`). The MoE router and experts run in XLA einsums of their own (_moe_mlp),
# so they are no linears: they stay float under int8 / fp8
LINEARS: tuple[Linear, ...] = (
    Linear(
        leaf="wqkv",  # [L, Hkv, G + 2, hd, D] -> [L, Hkv * (G + 2) * hd, D]
        split=1,
        hf_modules=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        lora=("qkv",),
    ),
    Linear(
        leaf="wo",  # [L, D, Hkv, G, hd] -> [L, D, Hq * hd]
        in_axes=3,
        split=2,
        hf_modules=("self_attn.o_proj",),
        lora=("o",),
    ),
    Linear(
        leaf="w_gate_up",  # [L, 2, F, D] -> [2L, F, D]: gate of layer l at 2l, up at 2l + 1
        stack_axes=2,
        split=2,
        hf_modules=("mlp.gate_proj", "mlp.up_proj"),
        lora=("gate", "up"),
    ),
    Linear(leaf="w_down", split=2, hf_modules=("mlp.down_proj",), lora=("down",)),  # [L, D, F]
)
# every "layers" leaf tensor parallelism splits: the linears', q/k/v's bias as wqkv, and
# every expert's F (the router and the norms are replicated)
LAYER_SPLITS: Mapping[str, int] = MappingProxyType(
    {**linear_splits(LINEARS), "bqkv": 1, "w_experts_gate_up": 3, "w_experts_down": 3}
)

# llama.cpp's per-layer tensor names -> transformers' (convert_hf_to_gguf.py)
GGUF_LAYER_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
_GGUF_NORMS = MappingProxyType(
    {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
)


def _gguf_config(g: GgufMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A Llama GGUF file's biases and Llama 3.1 rope scaling."""
    return {
        **config,
        "attention_bias": g.has_tensor("blk.0.attn_q.bias"),
        "mlp_bias": g.has_tensor("blk.0.ffn_up.bias"),
        "rope_scaling": _gguf_rope_scaling(g, config["head_dim"], config["rope_theta"]),
    }


def _gguf_rope_scaling(g: GgufMetadata, head_dim: int, theta: float) -> dict | None:
    """Recover Llama 3.1 rope scaling, which llama.cpp stores only as the `rope_freqs` tensor
    (per-frequency divisors), by matching it against the parameters Meta published."""
    if not g.has_tensor("rope_freqs.weight"):
        return None
    factors = g.float_tensor("rope_freqs.weight").reshape(-1)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        for low, high, original in ((1.0, 4.0, 8192),):
            low_wl, high_wl = original / low, original / high
            smooth = (original / wavelen - low) / (high - low)
            expect = np.where(
                wavelen < high_wl,
                1.0,
                np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)),
            )
            if expect.shape == factors.shape and np.allclose(expect, factors, rtol=1e-4):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": original,
                }
    raise ValueError(
        f"GGUF tensor 'rope_freqs.weight' of {g.path} matches no known llama3 rope scaling"
    )


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
    if c.model_type == "phi3":
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
        if c.model_type == "phi3":
            first, second = np.arange(2 * f), np.arange(2 * f) - f  # gate rows, then up rows
            gate = LoraPiece("gate", 0, np.where(first < f, first, -1))
            modules["mlp.gate_up_proj"] = LoraModule(d, 2 * f, (gate, LoraPiece("up", 0, second)))
        else:
            modules["mlp.gate_proj"] = LoraModule(d, f, (LoraPiece("gate"),))
            modules["mlp.up_proj"] = LoraModule(d, f, (LoraPiece("up"),))
    return LoraLayout(
        layer_prefix="model.layers.{}.", sites=sites, modules=modules, parameters=parameters
    )


def _refused(config: ModelConfig) -> dict[str, str]:
    refused = {}
    if config.num_experts:
        refused["gguf_quantized"] = "a mixture-of-experts GGUF import is read as floats"
    if config.model_type == "phi3":
        refused["prequantized"] = (
            "its fused qkv_proj and gate_up_proj are read as floats only; load its float "
            "checkpoint instead"
        )
    if config.model_type not in ("llama", "qwen2") or config.qk_norm:
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
    gguf=(
        GgufLayout(
            architecture="llama",
            model_type="llama",
            hf_architecture="LlamaForCausalLM",
            layer_tensors=GGUF_LAYER_TENSORS,
            permuted_qk=True,  # llama.cpp permutes q/k rows for this architecture only
            layer_norms=_GGUF_NORMS,
            config_fields=_gguf_config,
        ),
        GgufLayout(
            architecture="qwen2",
            model_type="qwen2",
            hf_architecture="Qwen2ForCausalLM",
            layer_tensors=GGUF_LAYER_TENSORS,
            layer_norms=_GGUF_NORMS,
        ),
    ),
    refused=_refused,
    lora=lora_layout,
)
