"""Gemma 2 and Gemma 3 (text) as one NNX module.

What sets them apart from the Llama family, all as transformers computes it: embeddings
scaled by sqrt(hidden) (rounded to the weights' dtype), RMSNorms that scale by (1 + weight),
norms after attention and after the MLP as well as before, a GELU-tanh gated MLP, attention
scaled by ``query_pre_attn_scalar ** -0.5``, soft caps on the attention logits (Gemma 2) and
the final logits, and local (sliding-window) layers interleaved with global ones; Gemma 3
adds q/k norms and gives the local layers their own rotary base.

The state is a params tree with the layers stacked on a leading L axis, matmul weights
[out, in] as HF stores them (norm weights as HF stores them too: the +1 is applied here):

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D],
                "wqkv": [L, Hkv, G + 2, hd, D],   # per KV head: its G query heads, k, v
                "q_norm", "k_norm": [L, hd],      # Gemma 3 only
                "wo": [L, D, Hkv, G, hd],
                "post_attn_norm", "pre_mlp_norm": [L, D],
                "w_gate_up": [L, 2, F, D], "w_down": [L, D, F],
                "post_mlp_norm": [L, D]},
     "final_norm": [D],
     "lm_head": [V, D]}     # absent (the projection is "embed") unless int8 or packed added it

Every matmul is a `blocks.projection` of the Llama family's declared linears (its
``linear_fn`` over the stacked weight: the CPU platform's native kernel reads layer
``index`` in place), with no fused norm or residual: Gemma's norms scale by (1 + weight) and
its post-norms sit between the product and the residual add.

The kernels take the sliding window as a static argument, so the decoder scans over periods
of the layer pattern (Gemma 2: local, global; Gemma 3: five local, one global) with the
layers of one period unrolled, and runs any remainder after: compile time stays that of one
period however deep the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .blocks import LayerLinears, projection
from .config import ModelConfig, RopeScaling
from .family import GgufLayout, GgufMetadata, ModelFamily, gguf_layout_of
from .layers import StackedParams, apply_rope, dense_causal_attention, param
from .linear import linear_splits, linear_xla
from .llama import LINEARS, lora_layout
from .lora_term import LoraInputs
from .quant.matmul import embedding_rows, vocab_logits
from .rope import rope_attention_factor, rope_inv_freq_at
from .types import AttentionFn, LinearFn, Params, TensorReader


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaVariant:
    """What one model_type of the Gemma family changes, declared once (VARIANTS)."""

    # layers default to sliding_window_pattern's (Gemma 3) or alternate local and global
    pattern_from_config: bool
    qk_norm: bool
    local_rope_base: bool  # the local layers' own rope base (rope_local_base_freq)


VARIANTS: Mapping[str, GemmaVariant] = MappingProxyType(
    {
        "gemma2": GemmaVariant(pattern_from_config=False, qk_norm=False, local_rope_base=False),
        "gemma3_text": GemmaVariant(pattern_from_config=True, qk_norm=True, local_rope_base=True),
    }
)
MODEL_TYPES = tuple(VARIANTS)
LAYER_TYPES = ("sliding_attention", "full_attention")
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


# ------------------------------------------------------------------- config


def parse_config(d: Mapping) -> ModelConfig:
    return ModelConfig(**gemma_config_fields(d))


def gemma_config_fields(d: Mapping) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2 / Gemma 3 text config.json; ValueError naming an
    option jaxpaged does not run."""
    try:
        return _gemma_config_fields(d)
    except KeyError as e:
        raise ValueError(f"{d['model_type']} config.json lacks the field {e.args[0]!r}") from None


def _gemma_config_fields(d: Mapping) -> dict[str, Any]:
    model_type = d["model_type"]
    variant = VARIANTS[model_type]
    if d.get("attention_bias"):
        raise ValueError(f"unsupported {model_type} option attention_bias=True")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"unsupported {model_type} option use_bidirectional_attention=True")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"unsupported {model_type} hidden_activation {act!r}; supported: "
            f"{', '.join(_ACTIVATIONS)}"
        )
    n = d["num_hidden_layers"]
    layer_types = d.get("layer_types")
    if layer_types is None:  # as transformers derives them
        period = _gemma3_pattern(d) if variant.pattern_from_config else 2
        layer_types = [
            "sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)
        ]
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad or len(layer_types) != n:
        raise ValueError(
            f"unsupported {model_type} layer_types {bad or layer_types!r}: jaxpaged runs "
            f"{n} layers each one of {', '.join(LAYER_TYPES)}"
        )
    max_pos = d.get("max_position_embeddings", 8192)
    theta, scaling, local_theta = _rope(d, max_pos, local_base=variant.local_rope_base)
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    eos = d.get("eos_token_id")
    window = d.get("sliding_window")
    soft_cap = d.get("attn_logit_softcapping")
    final_cap = d.get("final_logit_softcapping")
    return dict(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=n,
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        qk_norm=variant.qk_norm,
        sliding_window=int(window) if window else None,
        layer_types=tuple(layer_types),
        hidden_act=act,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or head_dim),
        attn_soft_cap=float(soft_cap) if soft_cap else None,
        final_soft_cap=float(final_cap) if final_cap else None,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def _gemma3_pattern(d: Mapping) -> int:
    return int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)


def _rope(
    d: Mapping, max_pos: int, *, local_base: bool
) -> tuple[float, RopeScaling | None, float | None]:
    """(global rope base, global scaling, local rope base or None) from either config format:
    transformers 5's ``rope_parameters`` (Gemma 3: one entry per layer type) or 4's
    ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` (read if ``local_base``:
    the variant's local layers have a base of their own)."""
    rope = d.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        full = rope.get("full_attention") or {}
        local = rope.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(
                f"unsupported {d['model_type']} rope scaling {local.get('rope_type')!r} on the "
                "sliding_attention layers"
            )
        theta = float(full.get("rope_theta", d.get("rope_theta", 10000.0)))
        local_theta = local.get("rope_theta", d.get("rope_local_base_freq"))
        return theta, _global_scaling(d, full, max_pos), _opt_float(local_theta)
    rope = rope or d.get("rope_scaling") or {}
    theta = float(d.get("rope_theta", rope.get("rope_theta", 10000.0)))
    local_theta = d.get("rope_local_base_freq") if local_base else None
    return theta, _global_scaling(d, rope, max_pos), _opt_float(local_theta)


def _global_scaling(d: Mapping, rope: Mapping, max_pos: int) -> RopeScaling | None:
    scaling = RopeScaling.from_hf_dict(rope, max_pos)
    if scaling is not None and scaling.rope_type == "dynamic":  # needs per-sequence lengths,
        # which only the Llama family's forward takes
        raise ValueError(f"unsupported {d['model_type']} rope type 'dynamic'")
    return scaling


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    c = config
    g = c.queries_per_kv
    n, d, hd, f = c.num_layers, c.hidden_size, c.head_dim, c.intermediate_size
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (n, d),
        "wqkv": (n, c.num_kv_heads, g + 2, hd, d),
        "wo": (n, d, c.num_kv_heads, g, hd),
        "post_attn_norm": (n, d),
        "pre_mlp_norm": (n, d),
        "w_gate_up": (n, 2, f, d),
        "w_down": (n, d, f),
        "post_mlp_norm": (n, d),
    }
    if c.qk_norm:
        layers["q_norm"] = (n, hd)
        layers["k_norm"] = (n, hd)
    return {"embed": (c.vocab_size, d), "layers": layers, "final_norm": (d,)}


# ------------------------------------------------------------------- forward


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm scaling by (1 + weight), all in float32, cast back once (as transformers)."""
    # x: [..., N], weight: [N]
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global attention)."""
    return tuple(
        config.sliding_window if t == "sliding_attention" else None for t in config.layer_types
    )


def _period(windows: tuple[int | None, ...]) -> int:
    """The shortest p with windows[i] == windows[i % p] for every layer i."""
    n = len(windows)
    return next(p for p in range(1, n + 1) if all(windows[i] == windows[i % p] for i in range(n)))


def _layer(
    x: jax.Array,  # [T, D]
    layers: dict[str, jax.Array],  # every layer's params, stacked on a leading L axis
    layer: jax.Array | int,  # int32 []
    positions: jax.Array,  # int32 [T]
    cache: Any,
    *,
    config: ModelConfig,
    window: int | None,
    attention_fn: AttentionFn,
    linear_fn: LinearFn,
    lora: LoraInputs | None = None,
) -> tuple[jax.Array, Any]:
    c = config
    t, g, hd, eps = x.shape[0], c.queries_per_kv, c.head_dim, c.rms_norm_eps
    # norms sliced to the layer; matmul weights go to linear_fn whole, read in place
    lin = LayerLinears.of(layers, LINEARS, layer, linear_fn, lora)
    w = {k: v[layer] for k, v in layers.items() if k not in lin.views}
    h = gemma_rms_norm(x, w["attn_norm"], eps)
    qkv = projection(lin, "wqkv", h).reshape(t, c.num_kv_heads, g + 2, hd)
    q = qkv[:, :, :g].reshape(t, c.num_heads, hd)
    k, v = qkv[:, :, g], qkv[:, :, g + 1]  # [T, Hkv, hd]
    if c.qk_norm:
        q = gemma_rms_norm(q, w["q_norm"], eps)
        k = gemma_rms_norm(k, w["k_norm"], eps)
    rope = c
    if window is not None and c.rope_local_theta is not None:  # Gemma 3's local layers
        rope = dataclasses.replace(c, rope_theta=c.rope_local_theta, rope_scaling=None)
    inv_freq, factor = rope_inv_freq_at(rope, positions), rope_attention_factor(rope)
    q, k = apply_rope(q, positions, inv_freq, factor), apply_rope(k, positions, inv_freq, factor)
    attn, cache = attention_fn(
        q, k, v, layer, cache,
        sm_scale=c.query_pre_attn_scalar**-0.5, sliding_window=window, soft_cap=c.attn_soft_cap,
    )  # fmt: skip
    attn = attn.astype(x.dtype).reshape(t, c.num_heads * hd)  # heads grouped by KV head
    o = projection(lin, "wo", attn)
    x = x + gemma_rms_norm(o, w["post_attn_norm"], eps)
    h = gemma_rms_norm(x, w["pre_mlp_norm"], eps)
    gate = projection(lin, "w_gate_up", h, part=0)
    up = projection(lin, "w_gate_up", h, part=1)
    act = _ACTIVATIONS[c.hidden_act](gate) * up
    mlp = projection(lin, "w_down", act)
    return x + gemma_rms_norm(mlp, w["post_mlp_norm"], eps), cache


class GemmaForCausalLM(nnx.Module):
    """Gemma 2 and Gemma 3 (text); the state is the params tree of the module docstring.

    ``lm_head``: whether the state holds the vocabulary projection's own copy besides the
    tied embedding (int8 weights quantize it, a native matmul packs it: see
    `linear.map_matmul_weights`)."""

    model_types: tuple[str, ...] = MODEL_TYPES  # the configs it runs

    def __init__(
        self, config: ModelConfig, *, dtype: Any = jnp.float32, lm_head: bool = False
    ) -> None:
        if config.model_type not in self.model_types or len(config.layer_types) != (
            config.num_layers
        ):
            raise ValueError("GemmaForCausalLM needs a gemma2 / gemma3_text config")
        self.config = config
        shapes = param_shapes(config)
        self.embed = param(jnp.zeros(shapes["embed"], dtype), split=0)  # by vocabulary
        # the Llama family's linears and splits; the extra norms are replicated
        self.layers = StackedParams(shapes["layers"], dtype, splits=linear_splits(LINEARS))
        self.final_norm = nnx.Param(jnp.zeros(shapes["final_norm"], dtype))
        if lm_head:
            self.lm_head = param(jnp.zeros(shapes["embed"], dtype), split=0)

    @classmethod
    def graphdef_for(cls, config: ModelConfig, params: Params) -> nnx.GraphDef:
        has_head = "lm_head" in params
        return nnx.graphdef(nnx.eval_shape(lambda: cls(config, lm_head=has_head)))

    @classmethod
    def from_params(cls, config: ModelConfig, params: Params) -> GemmaForCausalLM:
        """The module over ``params`` as they are (arrays are not copied)."""
        return nnx.merge(cls.graphdef_for(config, params), params)

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
        image_embeds: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, Any]:
        """Final-normed hidden states [T, D] and the cache threaded through every layer;
        ``linear_fn`` does every matmul (None: `linear_xla`). ``activation_dtype``: the
        hidden states' dtype between layers (None: the params'), e.g. float32 where a
        ``linear_fn`` computes bfloat16 weights in float32.
        ``lora`` adds each token's adapter term after the matmuls it targets.
        ``image_embeds``: (features [T, D], bool [T]) rows that replace the scaled token
        embeddings where the mask is set (image placeholders, models/gemma3_vl.py)."""
        c = self.config
        embed = self.embed.get_value()
        # a quantized table's rows come back in float32: the float leaves' dtype, as a float
        # table's own
        x = embedding_rows(embed, tokens).astype(self.final_norm[...].dtype)
        x = x * jnp.asarray(math.sqrt(c.hidden_size), x.dtype)
        if image_embeds is not None:
            features, mask = image_embeds
            x = jnp.where(mask[:, None], features.astype(x.dtype), x)
        if activation_dtype is not None:
            x = x.astype(activation_dtype)
        layers = self.layers.arrays()
        windows = layer_windows(c)
        p = _period(windows)
        run = dict(
            config=c, attention_fn=attention_fn, linear_fn=linear_fn or linear_xla, lora=lora
        )

        def period(carry, first):  # layers first .. first + p - 1, unrolled
            x, cache = carry
            for j in range(p):
                x, cache = _layer(x, layers, first + j, positions, cache, window=windows[j], **run)
            return (x, cache), None

        whole = c.num_layers // p
        firsts = jnp.arange(whole, dtype=jnp.int32) * p
        (x, cache), _ = jax.lax.scan(period, (x, cache), firsts)
        for i in range(whole * p, c.num_layers):
            x, cache = _layer(x, layers, i, positions, cache, window=windows[i], **run)
        return gemma_rms_norm(x, self.final_norm[...], c.rms_norm_eps), cache

    def compute_logits(
        self,
        hidden: jax.Array,  # [S, D]
        *,
        linear_fn: LinearFn | None = None,
    ) -> jax.Array:  # float32 [S, V]
        """Vocabulary logits over the tied embedding (or its own copy, "lm_head"),
        soft-capped if the config says so."""
        w = (self.lm_head if hasattr(self, "lm_head") else self.embed).get_value()  # [V, D]
        if linear_fn is not None:
            logits = linear_fn(hidden, w[None], 0).astype(jnp.float32)
        else:
            logits = vocab_logits(hidden, w)
        cap = self.config.final_soft_cap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


# ------------------------------------------------------------------- loading

_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "pre_mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def load_host_params(
    read: TensorReader, config: ModelConfig, layers: dict[str, Any]
) -> dict[str, Any]:
    """The params tree from HF tensors; ``read(name, shape)`` checks presence and shape."""
    c = config
    if not c.tie_word_embeddings:
        raise ValueError(f"unsupported {c.model_type} option tie_word_embeddings=False")
    g, hkv, hd, d, f = (
        c.queries_per_kv,
        c.num_kv_heads,
        c.head_dim,
        c.hidden_size,
        c.intermediate_size,
    )
    shapes = param_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        L = {k: v[i] for k, v in layers.items()}  # views into layer i
        for ours, theirs in _NORMS.items():
            L[ours][:] = read(p + theirs + ".weight", (d,))
        wqkv = L["wqkv"]  # [Hkv, G + 2, hd, D]
        wqkv[:, :g] = read(p + "self_attn.q_proj.weight", (c.num_heads * hd, d)).reshape(
            hkv, g, hd, d
        )
        wqkv[:, g] = read(p + "self_attn.k_proj.weight", (hkv * hd, d)).reshape(hkv, hd, d)
        wqkv[:, g + 1] = read(p + "self_attn.v_proj.weight", (hkv * hd, d)).reshape(hkv, hd, d)
        if c.qk_norm:
            L["q_norm"][:] = read(p + "self_attn.q_norm.weight", (hd,))
            L["k_norm"][:] = read(p + "self_attn.k_norm.weight", (hd,))
        L["wo"][:] = read(p + "self_attn.o_proj.weight", (d, c.num_heads * hd)).reshape(
            d, hkv, g, hd
        )
        L["w_gate_up"][0] = read(p + "mlp.gate_proj.weight", (f, d))
        L["w_gate_up"][1] = read(p + "mlp.up_proj.weight", (f, d))
        L["w_down"][:] = read(p + "mlp.down_proj.weight", (d, f))
    return {
        "embed": read("model.embed_tokens.weight", shapes["embed"]),
        "layers": layers,
        "final_norm": read("model.norm.weight", (d,)),
    }


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
    """`GemmaForCausalLM.__call__` over a params tree: final-normed hidden states [T, D]."""
    return GemmaForCausalLM.from_params(config, params)(
        tokens, positions, attention_fn, cache, linear_fn=linear_fn,
        activation_dtype=activation_dtype,
    )  # fmt: skip


# ------------------------------------------------------------------- family

# llama.cpp's Gemma 3 per-layer tensor names -> transformers' (ffn_norm is the pre-MLP one)
GGUF_LAYER_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
)
_GGUF_NORMS = MappingProxyType(
    {
        **{ours: theirs for ours, theirs in _NORMS.items()},
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
    }
)


def _gguf_config(g: GgufMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 3 config.json holds beyond the Llama fields. GGUF stores neither the layer
    pattern, the local rope base nor the attention scale: llama.cpp fixes them (one global
    layer in six, base 10000, head_dim ** -0.5 except 27B's (hidden / heads) ** -0.5), and so
    does transformers' Gemma3TextConfig, whose defaults this writes out."""
    n = config["num_hidden_layers"]
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    scalar = config["hidden_size"] // heads if n == 62 else head_dim  # 27B: 62 layers
    window = g.scalar("gemma3.attention.sliding_window", required=False)
    return {
        **{k: v for k, v in config.items() if k != "hidden_act"},  # Gemma's: hidden_activation
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": None if window is None else int(window),
        "layer_types": _gguf_layer_types(g, n),
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _gguf_layer_types(g: GgufMetadata, n: int) -> list[str]:
    """Sliding or full attention per layer: the file's sliding_window_pattern (a period, or
    one flag per layer, True for sliding) if it has one, else one full layer in six."""
    pattern = g.scalar("gemma3.attention.sliding_window_pattern", required=False, default=6)
    if not isinstance(pattern, list):
        pattern = [(i + 1) % int(pattern) for i in range(n)]
    elif len(pattern) != n:
        raise ValueError(
            f"GGUF file {g.path}: sliding_window_pattern lists {len(pattern)} of {n} layers"
        )
    sliding = [bool(x) for x in pattern]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


GGUF_LAYOUTS: tuple[GgufLayout, ...] = (
    GgufLayout(
        architecture="gemma3",
        model_type="gemma3_text",
        hf_architecture="Gemma3ForCausalLM",
        layer_tensors=GGUF_LAYER_TENSORS,
        plus_one_norms=True,  # llama.cpp's converter stores 1 + w
        layer_norms=_GGUF_NORMS,
        config_fields=_gguf_config,
    ),
)


def _refused(config: ModelConfig) -> Mapping[str, str]:
    refused = {}
    if gguf_layout_of(GGUF_LAYOUTS, config) is None:
        refused["gguf_quantized"] = "jaxpaged imports Gemma 3 GGUF files only"
    return refused


FAMILY = ModelFamily(
    name="gemma",
    architectures=("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
    model_types=MODEL_TYPES,
    parse_config=parse_config,
    module=GemmaForCausalLM,
    param_shapes=param_shapes,
    load_host_params=load_host_params,
    lora=lora_layout,  # the Llama family's sites and PEFT module names
    # the Llama family's linears: the same fused layout, split, checkpoint modules and sites
    linears=LINEARS,
    gguf=GGUF_LAYOUTS,
    refused=_refused,
)
