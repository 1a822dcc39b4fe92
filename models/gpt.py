"""GPT-2 and OPT: decoders with learned absolute positions, LayerNorm (with bias) before
attention and MLP, biased projections and a plain (non-gated) MLP, as one NNX module.

The state is a flat params tree with the layers stacked on a leading L axis (one
``lax.scan``), matmul weights [out, in] like HF's nn.Linear (GPT-2's Conv1D weights are
transposed at load):

    {"embed": [V, D], "pos_embed": [P, D],
     "layers": {"ln1_w", "ln1_b": [L, D], "wqkv": [L, 3, Hq * hd, D], "bqkv": [L, 3, Hq * hd],
                "wo": [L, D, Hq * hd], "bo": [L, D], "ln2_w", "ln2_b": [L, D],
                "w_fc": [L, F, D], "b_fc": [L, F], "w_proj": [L, D, F], "b_proj": [L, D]},
     "final_ln_w", "final_ln_b": [D],
     "lm_head": [V, D]}                      # absent when tied (both families' default)

Every matmul is a `blocks.projection` of a declared linear (``LINEARS``: the platform's
``linear_fn`` over the stacked weight, which the CPU's native kernel reads in place), the
bias added after it. The LayerNorms are not the RMSNorm ``linear_fn`` may fuse, and the
residual is added after the bias, as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .blocks import LayerLinears, projection
from .config import ModelConfig
from .family import LoraLayout, LoraModule, LoraPiece, LoraSite, ModelFamily
from .layers import StackedParams, dense_causal_attention, layer_norm, param
from .linear import Linear, linear_splits, linear_xla
from .lora_term import LoraInputs, lora_delta
from .quant.matmul import vocab_logits
from .types import AttentionFn, LinearFn, Params, TensorReader

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def parse_config(d: Mapping) -> ModelConfig:
    return ModelConfig(**gpt_config_fields(d))


def gpt_config_fields(d: Mapping) -> dict[str, Any]:
    """ModelConfig fields of a GPT-2 or OPT config.json; ValueError naming an option jaxpaged
    does not run."""
    try:
        return _gpt_config_fields(d)
    except KeyError as e:
        raise ValueError(f"{d['model_type']} config.json lacks the field {e.args[0]!r}") from None


def _gpt2_fields(d: Mapping) -> tuple[int, int, dict[str, Any]]:
    """(hidden size, heads, the variant's fields) of a GPT-2 config.json."""
    hidden, heads = d["n_embd"], d["n_head"]
    for option in ("scale_attn_by_inverse_layer_idx",):
        if d.get(option):
            raise ValueError(f"unsupported gpt2 option {option}=True")
    if d.get("scale_attn_weights") is False:
        raise ValueError("unsupported gpt2 option scale_attn_weights=False")
    return (
        hidden,
        heads,
        dict(
            num_layers=d["n_layer"],
            intermediate_size=d.get("n_inner") or 4 * hidden,
            max_position_embeddings=d.get("n_positions", 1024),
            rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
            hidden_act=d.get("activation_function", "gelu_new"),
            position_offset=0,
            conv1d_weights=True,
        ),
    )


def _opt_fields(d: Mapping) -> tuple[int, int, dict[str, Any]]:
    """(hidden size, heads, the variant's fields) of an OPT config.json."""
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    for option, ok in (
        ("do_layer_norm_before", True),
        ("enable_bias", True),
        ("layer_norm_elementwise_affine", True),
        ("_remove_final_layer_norm", False),
    ):
        if d.get(option, ok) != ok:
            raise ValueError(f"unsupported opt option {option}={d[option]!r}")
    if d.get("word_embed_proj_dim", hidden) != hidden:
        raise ValueError(
            "unsupported opt option word_embed_proj_dim != hidden_size (project_in/out)"
        )
    return (
        hidden,
        heads,
        dict(
            num_layers=d["num_hidden_layers"],
            intermediate_size=d["ffn_dim"],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=1e-5,  # nn.LayerNorm's default, which OPT uses
            hidden_act=d.get("activation_function", "relu"),
            position_offset=2,  # OPTLearnedPositionalEmbedding's offset
            conv1d_weights=False,
        ),
    )


# the variants, by config.json model_type: each reads its own field names
VARIANT_FIELDS: Mapping[str, Callable[[Mapping], tuple[int, int, dict[str, Any]]]] = (
    MappingProxyType({"gpt2": _gpt2_fields, "opt": _opt_fields})
)


def _gpt_config_fields(d: Mapping) -> dict[str, Any]:
    model_type = d["model_type"]
    hidden, heads, fields = VARIANT_FIELDS[model_type](d)
    if fields["hidden_act"] not in ACTIVATIONS:
        raise ValueError(
            f"unsupported {model_type} activation_function {fields['hidden_act']!r}; "
            f"supported: {', '.join(ACTIVATIONS)}"
        )
    eos = d.get("eos_token_id")
    return dict(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        **fields,
    )


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    c = config
    n, d, f, q = c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    layers = {
        "ln1_w": (n, d), "ln1_b": (n, d),
        "wqkv": (n, 3, q, d), "bqkv": (n, 3, q),
        "wo": (n, d, q), "bo": (n, d),
        "ln2_w": (n, d), "ln2_b": (n, d),
        "w_fc": (n, f, d), "b_fc": (n, f),
        "w_proj": (n, d, f), "b_proj": (n, d),
    }  # fmt: skip
    shapes: dict[str, Any] = {
        "embed": (c.vocab_size, d),
        "pos_embed": (c.max_position_embeddings + c.position_offset, d),
        "layers": layers,
        "final_ln_w": (d,),
        "final_ln_b": (d,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.vocab_size, d)
    return shapes


class GPTForCausalLM(nnx.Module):
    """GPT-2 and OPT; the state is the params tree of the module docstring.

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
        positions: jax.Array,  # int32 [T]
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
        c = self.config
        linear_fn = linear_fn or linear_xla
        eps, act = c.rms_norm_eps, ACTIVATIONS[c.hidden_act]
        t, h, hd = tokens.shape[0], c.num_heads, c.head_dim
        x = jnp.take(self.embed[...], tokens, axis=0)
        x = x + jnp.take(self.pos_embed[...], positions + c.position_offset, axis=0)
        if activation_dtype is not None:
            x = x.astype(activation_dtype)
        layers = self.layers.arrays()

        def body(carry, layer):
            x, cache = carry
            # norms and biases sliced to the layer; matmul weights go to linear_fn whole
            lin = LayerLinears.of(layers, LINEARS, layer, linear_fn, lora)
            w = {k: v[layer] for k, v in layers.items() if k not in lin.views}
            y = layer_norm(x, w["ln1_w"], w["ln1_b"], eps)
            q, k, v = (  # q, k and v share one LoRA site: its term is split below
                projection(lin, "wqkv", y, part=i, bias=w["bqkv"][i], lora=False).reshape(t, h, hd)
                for i in range(3)
            )
            if lora is not None:  # after the base products, on the same input
                delta = lora_delta(y, lora, "qkv", layer).reshape(t, 3, h, hd)
                q, k, v = q + delta[:, 0], k + delta[:, 1], v + delta[:, 2]
            attn, cache = attention_fn(q, k, v, layer, cache)
            attn = attn.astype(x.dtype).reshape(t, h * hd)
            x = x + projection(lin, "wo", attn, bias=w["bo"])
            y = layer_norm(x, w["ln2_w"], w["ln2_b"], eps)
            y = act(projection(lin, "w_fc", y, bias=w["b_fc"]))
            x = x + projection(lin, "w_proj", y, bias=w["b_proj"])
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
    shape (GPT-2's Conv1D weights are read [in, out] and transposed)."""
    c = config
    d, f, q = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    shapes = param_shapes(c)
    gpt2 = c.conv1d_weights  # GPT-2's names and Conv1D weights, else OPT's
    for i in range(c.num_layers):
        L = {k: v[i] for k, v in layers.items()}  # views into layer i
        if gpt2:
            p = f"transformer.h.{i}."
            L["ln1_w"][:], L["ln1_b"][:] = (
                read(p + "ln_1.weight", (d,)),
                read(p + "ln_1.bias", (d,)),
            )
            L["ln2_w"][:], L["ln2_b"][:] = (
                read(p + "ln_2.weight", (d,)),
                read(p + "ln_2.bias", (d,)),
            )
            L["wqkv"][:] = read(p + "attn.c_attn.weight", (d, 3 * q)).T.reshape(3, q, d)
            L["bqkv"][:] = read(p + "attn.c_attn.bias", (3 * q,)).reshape(3, q)
            L["wo"][:] = read(p + "attn.c_proj.weight", (q, d)).T
            L["bo"][:] = read(p + "attn.c_proj.bias", (d,))
            L["w_fc"][:] = read(p + "mlp.c_fc.weight", (d, f)).T
            L["b_fc"][:] = read(p + "mlp.c_fc.bias", (f,))
            L["w_proj"][:] = read(p + "mlp.c_proj.weight", (f, d)).T
            L["b_proj"][:] = read(p + "mlp.c_proj.bias", (d,))
        else:
            p = f"model.decoder.layers.{i}."
            ln = (("ln1", "self_attn_layer_norm"), ("ln2", "final_layer_norm"))
            for ours, theirs in ln:
                L[ours + "_w"][:] = read(p + theirs + ".weight", (d,))
                L[ours + "_b"][:] = read(p + theirs + ".bias", (d,))
            for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
                L["wqkv"][j] = read(p + f"self_attn.{name}.weight", (q, d))
                L["bqkv"][j] = read(p + f"self_attn.{name}.bias", (q,))
            L["wo"][:] = read(p + "self_attn.out_proj.weight", (d, q))
            L["bo"][:] = read(p + "self_attn.out_proj.bias", (d,))
            L["w_fc"][:], L["b_fc"][:] = read(p + "fc1.weight", (f, d)), read(p + "fc1.bias", (f,))
            L["w_proj"][:] = read(p + "fc2.weight", (d, f))
            L["b_proj"][:] = read(p + "fc2.bias", (d,))
    top = "transformer." if gpt2 else "model.decoder."
    names = (
        {"embed": "wte", "pos_embed": "wpe", "final_ln_w": "ln_f.weight", "final_ln_b": "ln_f.bias"}
        if gpt2
        else {
            "embed": "embed_tokens",
            "pos_embed": "embed_positions",
            "final_ln_w": "final_layer_norm.weight",
            "final_ln_b": "final_layer_norm.bias",
        }
    )
    host: dict[str, Any] = {"layers": layers}
    for ours, theirs in names.items():
        full = top + theirs + ("" if theirs.endswith(("weight", "bias")) else ".weight")
        host[ours] = read(full, shapes[ours])
    if not c.tie_word_embeddings:
        host["lm_head"] = read("lm_head.weight", shapes["lm_head"])
    return host


# ------------------------------------------------------------------- family

# The decoder layer's linears (models/linear.py) with their Megatron split: wqkv [L, 3,
# Hq*hd, D] over Hq*hd (whole heads; three dots, q, k, v of layer l at 3l, 3l + 1, 3l + 2,
# so the split stays whole), wo over Hq*hd, the MLP over F. No pre-quantized checkpoint
# modules: the family reads float checkpoints only
LINEARS: tuple[Linear, ...] = (
    Linear(leaf="wqkv", stack_axes=2, split=2, lora=("qkv",)),  # [L, 3, Hq*hd, D]
    Linear(leaf="wo", split=2, lora=("o",)),  # [L, D, Hq*hd]
    Linear(leaf="w_fc", split=1, lora=("fc",)),  # [L, F, D]
    Linear(leaf="w_proj", split=2, lora=("proj",)),  # [L, D, F]
)
# the "layers" leaves tensor parallelism splits: the linears', and the column-parallel
# layers' biases with them; the row-parallel layers' biases, the LayerNorms and the learned
# positions are replicated
LAYER_SPLITS: Mapping[str, int] = MappingProxyType({**linear_splits(LINEARS), "bqkv": 2, "b_fc": 1})


def lora_layout(config: ModelConfig) -> LoraLayout:
    """The LoRA sites of the forward and the PEFT modules that fill them (models/lora.py):
    qkv (rows q, k, v as wqkv [3, Hq*hd]: GPT-2's fused Conv1D c_attn as one rank block,
    OPT's q_proj, k_proj, v_proj as three), o (attn.c_proj / self_attn.out_proj), fc
    (mlp.c_fc / fc1) and proj (mlp.c_proj / fc2)."""
    c = config
    d, f, q = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    gpt2 = c.conv1d_weights  # GPT-2's modules, else OPT's
    sites = {
        "qkv": LoraSite(d, 3 * q, parts=1 if gpt2 else 3),
        "o": LoraSite(q, d),
        "fc": LoraSite(d, f),
        "proj": LoraSite(f, d),
    }
    if gpt2:
        modules = {"attn.c_attn": LoraModule(d, 3 * q, (LoraPiece("qkv"),))}
        names = ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    else:
        modules = {
            f"self_attn.{name}_proj": LoraModule(d, q, (LoraPiece("qkv", i, i * q + np.arange(q)),))
            for i, name in enumerate("qkv")
        }
        names = ("self_attn.out_proj", "fc1", "fc2")
    for name, site in zip(names, ("o", "fc", "proj"), strict=True):
        s = sites[site]
        modules[name] = LoraModule(s.in_features, s.out_features, (LoraPiece(site),))
    prefix = "transformer.h.{}." if gpt2 else "model.decoder.layers.{}."
    return LoraLayout(layer_prefix=prefix, sites=sites, modules=modules, conv1d=gpt2)


# what the biased, plain-MLP families (GPT-2, OPT, BLOOM) do not have, and why
FLOAT_FAMILY_REFUSALS: Mapping[str, str] = MappingProxyType(
    {
        "prequantized": "its weight mapping reads float tensors only; load its float "
        "checkpoint instead",
        "gguf_quantized": "jaxpaged imports no GGUF layout of this family",
    }
)


def _refused(config: ModelConfig) -> Mapping[str, str]:
    del config
    return FLOAT_FAMILY_REFUSALS


FAMILY = ModelFamily(
    name="gpt",
    architectures=("GPT2LMHeadModel", "OPTForCausalLM"),
    model_types=tuple(VARIANT_FIELDS),
    parse_config=parse_config,
    module=GPTForCausalLM,
    param_shapes=param_shapes,
    load_host_params=load_host_params,
    linears=LINEARS,
    refused=_refused,
    lora=lora_layout,
)
