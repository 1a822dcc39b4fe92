"""BLOOM: a decoder with no position encoding at all, only ALiBi biases on the attention
logits (``slope_h * (key_pos - query_pos)``, one slope per head), LayerNorms (one more right
after the embeddings), biased projections and a GELU MLP, as one NNX module.

The state is a flat params tree, layers stacked on a leading L axis (one ``lax.scan``),
matmul weights [out, in] like HF's nn.Linear:

    {"embed": [V, D], "embed_ln_w", "embed_ln_b": [D],
     "layers": {"ln1_w", "ln1_b": [L, D], "wqkv": [L, H, 3, hd, D], "bqkv": [L, H, 3, hd],
                "wo": [L, D, H, hd], "bo": [L, D], "ln2_w", "ln2_b": [L, D],
                "w_fc": [L, F, D], "b_fc": [L, F], "w_proj": [L, D, F], "b_proj": [L, D]},
     "final_ln_w", "final_ln_b": [D],
     "lm_head": [V, D]}                      # absent when tied (BLOOM's default)

HF's fused ``query_key_value`` weight [3 * D, D] holds its output rows per head as (q, k, v)
of hd rows each: ``wqkv`` is that weight reshaped, and it is the Llama family's fused layout
with one query per KV head ([L, Hkv, G + 2, hd, D], G = 1), so tensor parallelism splits
``wqkv``, ``bqkv`` and ``wo`` over heads by the same table (distributed/parallel.py).

Every matmul is a `blocks.projection` of a declared linear (``LINEARS``: the platform's
``linear_fn`` over the stacked weight, which the CPU's native kernel reads in place), the
bias added after it, the residual after the bias, as transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .blocks import LayerLinears, projection
from .config import ModelConfig
from .family import LoraLayout, LoraModule, LoraPiece, LoraSite, ModelFamily
from .gpt import FLOAT_FAMILY_REFUSALS
from .layers import StackedParams, alibi_slopes, dense_causal_attention, layer_norm, param
from .linear import Linear, linear_splits, linear_xla
from .lora_term import LoraInputs
from .quant.matmul import vocab_logits
from .types import AttentionFn, LinearFn, Params, TensorReader


def parse_config(d: Mapping) -> ModelConfig:
    return ModelConfig(**bloom_config_fields(d))


def bloom_config_fields(d: Mapping) -> dict[str, Any]:
    """ModelConfig fields of a BLOOM config.json (old ``n_embed`` / ``num_attention_heads``
    spellings too); ValueError naming an option jaxpaged does not run."""
    try:
        hidden = d["hidden_size"] if "hidden_size" in d else d["n_embed"]
        heads = d["n_head"] if "n_head" in d else d["num_attention_heads"]
        layers = d["n_layer"] if "n_layer" in d else d["num_hidden_layers"]
        vocab = d["vocab_size"]
    except KeyError as e:
        raise ValueError(f"bloom config.json lacks the field {e.args[0]!r}") from None
    if d.get("slow_but_exact") and d.get("pretraining_tp", 1) > 1:
        raise ValueError(
            "unsupported bloom option slow_but_exact=True with pretraining_tp > 1 (Megatron's "
            "sliced summation order of the output projections); jaxpaged runs slow_but_exact=False"
        )
    if hidden % heads:
        raise ValueError(f"bloom hidden_size ({hidden}) must be a multiple of n_head ({heads})")
    eos = d.get("eos_token_id")
    return dict(
        model_type="bloom",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,  # BloomMLP's fixed width
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
        # ALiBi has no table of positions; the length BLOOM was trained at bounds max_model_len
        max_position_embeddings=int(d.get("seq_length") or 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        hidden_act="bloom_gelu",
        alibi=True,
        residual_post_norm=bool(d.get("apply_residual_connection_post_layernorm", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    c = config
    n, d, f, h, hd = c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.head_dim
    layers = {
        "ln1_w": (n, d), "ln1_b": (n, d),
        "wqkv": (n, h, 3, hd, d), "bqkv": (n, h, 3, hd),
        "wo": (n, d, h, hd), "bo": (n, d),
        "ln2_w": (n, d), "ln2_b": (n, d),
        "w_fc": (n, f, d), "b_fc": (n, f),
        "w_proj": (n, d, f), "b_proj": (n, d),
    }  # fmt: skip
    shapes: dict[str, Any] = {
        "embed": (c.vocab_size, d),
        "embed_ln_w": (d,),
        "embed_ln_b": (d,),
        "layers": layers,
        "final_ln_w": (d,),
        "final_ln_b": (d,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.vocab_size, d)
    return shapes


def bloom_gelu(x: jax.Array) -> jax.Array:
    """BLOOM's tanh GELU with its own rounded constant (modeling_bloom.bloom_gelu_forward)."""
    return x * 0.5 * (1.0 + jnp.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))


class BloomForCausalLM(nnx.Module):
    """BLOOM; the state is the params tree of the module docstring.

    ``lm_head``: whether the state holds its own vocabulary projection (default: unless the
    embeddings are tied; int8 weights and packed params add one even when tied)."""

    def __init__(
        self, config: ModelConfig, *, dtype: Any = jnp.float32, lm_head: bool | None = None
    ) -> None:
        self.config = config
        shapes = param_shapes(config)
        if lm_head is not None:
            shapes.pop("lm_head", None)
            if lm_head:
                shapes["lm_head"] = shapes["embed"]
        self.layers = StackedParams(shapes["layers"], dtype, splits=LAYER_SPLITS)
        for name, shape in shapes.items():  # the vocabulary split, the rest replicated
            if name != "layers":
                split = 0 if name in ("embed", "lm_head") else None
                setattr(self, name, param(jnp.zeros(shape, dtype), split))

    @classmethod
    def graphdef_for(cls, config: ModelConfig, params: Params) -> nnx.GraphDef:
        has_head = "lm_head" in params
        return nnx.graphdef(nnx.eval_shape(lambda: cls(config, lm_head=has_head)))

    def __call__(
        self,
        tokens: jax.Array,  # int32 [T]
        positions: jax.Array,  # int32 [T]: unused (ALiBi needs only the kernel's positions)
        attention_fn: AttentionFn = dense_causal_attention,
        cache: Any = None,
        *,
        linear_fn: LinearFn | None = None,
        activation_dtype: Any = None,
        lora: LoraInputs | None = None,
    ) -> tuple[jax.Array, Any]:
        """Final-normed hidden states [T, D] and the cache threaded through every layer;
        ``linear_fn`` does every matmul (None: `linear_xla`). ``activation_dtype``: the
        hidden states' dtype between layers (None: the params').
        ``lora`` adds each token's adapter term after the matmuls it targets."""
        del positions
        c = self.config
        linear_fn = linear_fn or linear_xla
        eps, post = c.rms_norm_eps, c.residual_post_norm
        t, h, hd = tokens.shape[0], c.num_heads, c.head_dim
        slopes = jnp.asarray(alibi_slopes(c.num_heads))  # float32 [H], a constant of the program
        x = jnp.take(self.embed[...], tokens, axis=0)
        x = layer_norm(x, self.embed_ln_w[...], self.embed_ln_b[...], eps)
        if activation_dtype is not None:
            x = x.astype(activation_dtype)
        layers = self.layers.arrays()

        def body(carry, layer):
            x, cache = carry
            # norms and biases sliced to the layer; matmul weights go to linear_fn whole
            lin = LayerLinears.of(layers, LINEARS, layer, linear_fn, lora)
            w = {k: v[layer] for k, v in layers.items() if k not in lin.views}
            y = layer_norm(x, w["ln1_w"], w["ln1_b"], eps)
            qkv = projection(lin, "wqkv", y, bias=w["bqkv"].reshape(-1)).reshape(t, h, 3, hd)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            attn, cache = attention_fn(q, k, v, layer, cache, alibi_slopes=slopes)
            out = projection(lin, "wo", attn.astype(x.dtype).reshape(t, h * hd), bias=w["bo"])
            x = (y if post else x) + out
            y = layer_norm(x, w["ln2_w"], w["ln2_b"], eps)
            act = bloom_gelu(projection(lin, "w_fc", y, bias=w["b_fc"]))
            mlp = projection(lin, "w_proj", act, bias=w["b_proj"])
            x = (y if post else x) + mlp
            return (x, cache), None

        layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), layer_ids)
        return layer_norm(x, self.final_ln_w[...], self.final_ln_b[...], eps), cache

    def compute_logits(
        self,
        hidden: jax.Array,  # [S, D]
        *,
        linear_fn: LinearFn | None = None,
    ) -> jax.Array:  # float32 [S, V]
        w = (self.lm_head if hasattr(self, "lm_head") else self.embed).get_value()  # [V, D]
        if linear_fn is not None:
            return linear_fn(hidden, w[None], 0).astype(jnp.float32)
        return vocab_logits(hidden, w)


# ------------------------------------------------------------------- loading


def load_host_params(
    read: TensorReader, config: ModelConfig, layers: dict[str, Any]
) -> dict[str, Any]:
    """The params tree from HF tensors; ``read(name, shape)`` checks each one's presence and
    shape. Names without the ``transformer.`` prefix (a BloomModel checkpoint, as the
    bigscience/bloom* repositories store) are accepted too."""
    c = config
    d, f, h, hd = c.hidden_size, c.intermediate_size, c.num_heads, c.head_dim
    q = h * hd
    shapes = param_shapes(c)
    top = "transformer." if _has(read, "transformer.word_embeddings.weight") else ""
    for i in range(c.num_layers):
        L = {k: v[i] for k, v in layers.items()}  # views into layer i
        p = f"{top}h.{i}."
        for ours, theirs in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
            L[ours + "_w"][:] = read(p + theirs + ".weight", (d,))
            L[ours + "_b"][:] = read(p + theirs + ".bias", (d,))
        qkv = read(p + "self_attention.query_key_value.weight", (3 * q, d))  # rows (H, 3, hd)
        L["wqkv"][:] = qkv.reshape(h, 3, hd, d)
        L["bqkv"][:] = read(p + "self_attention.query_key_value.bias", (3 * q,)).reshape(h, 3, hd)
        L["wo"][:] = read(p + "self_attention.dense.weight", (d, q)).reshape(d, h, hd)
        L["bo"][:] = read(p + "self_attention.dense.bias", (d,))
        L["w_fc"][:] = read(p + "mlp.dense_h_to_4h.weight", (f, d))
        L["b_fc"][:] = read(p + "mlp.dense_h_to_4h.bias", (f,))
        L["w_proj"][:] = read(p + "mlp.dense_4h_to_h.weight", (d, f))
        L["b_proj"][:] = read(p + "mlp.dense_4h_to_h.bias", (d,))
    names = {
        "embed": "word_embeddings.weight",
        "embed_ln_w": "word_embeddings_layernorm.weight",
        "embed_ln_b": "word_embeddings_layernorm.bias",
        "final_ln_w": "ln_f.weight",
        "final_ln_b": "ln_f.bias",
    }
    host: dict[str, Any] = {"layers": layers}
    for ours, theirs in names.items():
        host[ours] = read(top + theirs, shapes[ours])
    if not c.tie_word_embeddings:
        host["lm_head"] = read("lm_head.weight", shapes["lm_head"])
    return host


def _has(read: Any, name: str) -> bool:
    st = getattr(read, "st", None)
    return st is None or name in st


# ------------------------------------------------------------------- family

# The decoder layer's linears (models/linear.py) with their Megatron split: the fused
# attention over heads (the Llama family's layout with G = 1), the plain MLP column- then
# row-parallel over F. No pre-quantized checkpoint modules: the family reads float
# checkpoints only
LINEARS: tuple[Linear, ...] = (
    Linear(leaf="wqkv", split=1, lora=("qkv",)),  # [L, H, 3, hd, D] -> [L, H*3*hd, D]
    Linear(leaf="wo", in_axes=2, split=2, lora=("o",)),  # [L, D, H, hd] -> [L, D, H*hd]
    Linear(leaf="w_fc", split=1, lora=("fc",)),  # [L, F, D]
    Linear(leaf="w_proj", split=2, lora=("proj",)),  # [L, D, F]
)
# the "layers" leaves tensor parallelism splits: the linears', and the column-parallel
# layers' biases with them (the row-parallel ones' and the LayerNorms are replicated)
LAYER_SPLITS: Mapping[str, int] = MappingProxyType({**linear_splits(LINEARS), "bqkv": 1, "b_fc": 1})


def lora_layout(config: ModelConfig) -> LoraLayout:
    """The LoRA sites of the forward and the PEFT modules that fill them (models/lora.py):
    qkv (query_key_value, rows as wqkv [H, 3, hd]), o (self_attention.dense), fc
    (mlp.dense_h_to_4h) and proj (mlp.dense_4h_to_h)."""
    d, f = config.hidden_size, config.intermediate_size
    q = config.num_heads * config.head_dim
    sites = {
        "qkv": LoraSite(d, 3 * q),
        "o": LoraSite(q, d),
        "fc": LoraSite(d, f),
        "proj": LoraSite(f, d),
    }
    names = {
        "self_attention.query_key_value": "qkv",
        "self_attention.dense": "o",
        "mlp.dense_h_to_4h": "fc",
        "mlp.dense_4h_to_h": "proj",
    }
    modules = {
        name: LoraModule(sites[site].in_features, sites[site].out_features, (LoraPiece(site),))
        for name, site in names.items()
    }
    return LoraLayout(layer_prefix="transformer.h.{}.", sites=sites, modules=modules)


def _refused(config: ModelConfig) -> Mapping[str, str]:
    del config
    return FLOAT_FAMILY_REFUSALS


FAMILY = ModelFamily(
    name="bloom",
    architectures=("BloomForCausalLM",),
    model_types=("bloom",),
    parse_config=parse_config,
    module=BloomForCausalLM,
    param_shapes=param_shapes,
    load_host_params=load_host_params,
    linears=LINEARS,
    refused=_refused,
    lora=lora_layout,
)
