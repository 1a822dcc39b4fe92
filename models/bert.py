"""BERT-style bidirectional encoders: BERT and RoBERTa / XLM-RoBERTa (transformers'
``BertModel``, ``RobertaModel``, ``XLMRobertaModel`` and their ``*ForSequenceClassification``
cross-encoders), for embeddings and scores (the pooling runner, jaxpaged/engine/pooling.py).

An encoder has no KV cache: it runs fixed-shape padded batches of whole sequences, tokens
[B, S] with an attention mask [B, S] that hides the padding keys. Post-norm layers (the
residual added, then LayerNorm), biased projections, exact GELU. RoBERTa's learned positions
start after its padding id: position of token j is ``j + pad_token_id + 1`` (transformers'
``create_position_ids_from_input_ids``), which ``position_offset`` holds.

The state is a flat params tree, the layers stacked on a leading L axis (one ``lax.scan``),
matmul weights [out, in] like HF's nn.Linear:

    {"word_embed": [V, D], "pos_embed": [P, D], "type_embed": [Tt, D],
     "embed_ln_w", "embed_ln_b": [D],
     "layers": {"wqkv": [L, 3, D, D], "bqkv": [L, 3, D], "wo": [L, D, D], "bo": [L, D],
                "ln1_w", "ln1_b": [L, D], "w_in": [L, F, D], "b_in": [L, F],
                "w_out": [L, D, F], "b_out": [L, D], "ln2_w", "ln2_b": [L, D]},
     # a *ForSequenceClassification checkpoint only: out(tanh(dense(hidden[:, 0])))
     "head_dense_w": [D, D], "head_dense_b": [D], "head_out_w": [C, D], "head_out_b": [C]}

The classification head is the same computation for both variants: BERT's pooler (dense +
tanh on the first token) then its ``classifier``; RoBERTa's ``classifier.dense``, tanh, then
``classifier.out_proj``.
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

from .config import ModelConfig
from .family import ModelFamily
from .layers import StackedParams, layer_norm
from .types import Params, TensorReader

ACTIVATIONS: Mapping[str, Callable[[jax.Array], jax.Array]] = MappingProxyType(
    {
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "relu": jax.nn.relu,
    }
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderVariant:
    """What one model_type of the encoder family changes, declared once (VARIANTS)."""

    checkpoint_prefix: str  # the encoder's prefix inside its task model
    pooler: bool  # a classifier's head: BERT's pooler then classifier, else RoBERTa's head
    positions_after_pad: bool  # position ids start after pad_token_id (RoBERTa's)


_ROBERTA = EncoderVariant(checkpoint_prefix="roberta.", pooler=False, positions_after_pad=True)
VARIANTS: Mapping[str, EncoderVariant] = MappingProxyType(
    {
        "bert": EncoderVariant(checkpoint_prefix="bert.", pooler=True, positions_after_pad=False),
        "roberta": _ROBERTA,
        "xlm-roberta": _ROBERTA,
    }
)

_CLASSIFIERS = (
    "BertForSequenceClassification",
    "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderConfig(ModelConfig):
    """A `ModelConfig` with what an encoder adds: token types, its padding id (RoBERTa's
    positions), LayerNorm's eps and, for a cross-encoder, its labels."""

    type_vocab_size: int = 2
    pad_token_id: int = 0
    layer_norm_eps: float = 1e-12
    num_labels: int = 0  # a *ForSequenceClassification head's outputs (0: no head)
    id2label: tuple[str, ...] = ()
    # a one-label cross-encoder's score: "sigmoid" of its logit (sentence-transformers'
    # CrossEncoder default) or the logit itself ("identity"), as the checkpoint says
    score_activation: str = "sigmoid"
    # Matryoshka embeddings: truncating to these dimensions is meaningful (vLLM reads the
    # same config.json fields); None: the model was not trained for it
    matryoshka_dimensions: tuple[int, ...] | None = None
    is_matryoshka: bool = False
    # the variant's checkpoint: the prefix of the encoder inside its task model ("bert.",
    # "roberta.") and a classifier's head: BERT's pooler (``bert.pooler.dense``, tanh) then
    # ``classifier`` (True), or RoBERTa's ``classifier.dense``, tanh, ``classifier.out_proj``
    checkpoint_prefix: str = "bert."
    pooler: bool = True

    @property
    def classifier(self) -> bool:
        return self.num_labels > 0


def parse_config(d: Mapping[str, Any]) -> EncoderConfig:
    """The EncoderConfig of a BERT / RoBERTa / XLM-R config.json; ValueError naming an
    option jaxpaged does not run."""
    try:
        return _parse_config(d)
    except KeyError as e:
        raise ValueError(
            f"{d.get('model_type')} config.json lacks the field {e.args[0]!r}"
        ) from None


def _parse_config(d: Mapping[str, Any]) -> EncoderConfig:
    model_type = d["model_type"]
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"unsupported {model_type} position_embedding_type "
            f"{d['position_embedding_type']!r}; supported: 'absolute'"
        )
    if d.get("is_decoder") or d.get("add_cross_attention"):
        raise ValueError(f"unsupported {model_type} option is_decoder / add_cross_attention")
    act = d.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"unsupported {model_type} hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    pad = int(d.get("pad_token_id") if d.get("pad_token_id") is not None else 0)
    variant = VARIANTS[model_type]
    classifier = any(a in _CLASSIFIERS for a in d.get("architectures") or ())
    labels: tuple[str, ...] = ()
    if classifier:
        id2label = d.get("id2label") or {}
        n = int(d.get("num_labels") or len(id2label) or 2)
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
    max_pos = int(d.get("max_position_embeddings", 512))
    st = d.get("sentence_transformers") or {}
    activation = str(st.get("activation_fn") or d.get("sbert_ce_default_activation_function") or "")
    score_activation = "identity" if activation.endswith("Identity") else "sigmoid"
    if activation and not activation.endswith(("Identity", "Sigmoid")):
        raise ValueError(f"unsupported cross-encoder activation function {activation!r}")
    offset = pad + 1 if variant.positions_after_pad else 0
    dims = d.get("matryoshka_dimensions")
    return EncoderConfig(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        hidden_act=act,
        # the embeddings table holds the offset rows too (RoBERTa's 514 for 512 tokens)
        max_position_embeddings=max_pos - offset,
        position_offset=offset,
        type_vocab_size=int(d.get("type_vocab_size", 2)),
        pad_token_id=pad,
        layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
        num_labels=len(labels),
        id2label=labels,
        score_activation=score_activation,
        matryoshka_dimensions=tuple(int(x) for x in dims) if dims else None,
        is_matryoshka=bool(d.get("is_matryoshka") or dims),
        checkpoint_prefix=variant.checkpoint_prefix,
        pooler=variant.pooler,
        bos_token_id=d.get("bos_token_id"),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    c = _encoder(config)
    n, d, f = c.num_layers, c.hidden_size, c.intermediate_size
    layers = {
        "wqkv": (n, 3, d, d), "bqkv": (n, 3, d),
        "wo": (n, d, d), "bo": (n, d),
        "ln1_w": (n, d), "ln1_b": (n, d),
        "w_in": (n, f, d), "b_in": (n, f),
        "w_out": (n, d, f), "b_out": (n, d),
        "ln2_w": (n, d), "ln2_b": (n, d),
    }  # fmt: skip
    shapes: dict[str, Any] = {
        "word_embed": (c.vocab_size, d),
        "pos_embed": (c.max_position_embeddings + c.position_offset, d),
        "type_embed": (c.type_vocab_size, d),
        "embed_ln_w": (d,),
        "embed_ln_b": (d,),
        "layers": layers,
    }
    if c.classifier:
        shapes.update(
            head_dense_w=(d, d),
            head_dense_b=(d,),
            head_out_w=(c.num_labels, d),
            head_out_b=(c.num_labels,),
        )
    return shapes


def _encoder(config: ModelConfig) -> EncoderConfig:
    if not isinstance(config, EncoderConfig):
        raise ValueError(f"an encoder needs an EncoderConfig, got {type(config).__name__}")
    return config


def load_host_params(read: TensorReader, config: ModelConfig, layers: dict[str, Any]) -> Params:
    """The params tree from the Hugging Face names: a bare encoder (``BertModel``'s
    ``embeddings.*``, ``encoder.layer.N.*``) or one under its task model's prefix
    (``bert.``, ``roberta.``)."""
    c = _encoder(config)
    d = c.hidden_size
    prefix = c.checkpoint_prefix
    try:  # a task model keeps its encoder under the prefix; a bare one has none
        word = read(f"{prefix}embeddings.word_embeddings.weight", (c.vocab_size, d))
    except ValueError:
        prefix = ""
        word = read("embeddings.word_embeddings.weight", (c.vocab_size, d))
    shapes = param_shapes(c)
    e = f"{prefix}embeddings."
    host: dict[str, Any] = {
        "word_embed": word,
        "pos_embed": read(f"{e}position_embeddings.weight", shapes["pos_embed"]),
        "type_embed": read(f"{e}token_type_embeddings.weight", shapes["type_embed"]),
        "embed_ln_w": read(f"{e}LayerNorm.weight", (d,)),
        "embed_ln_b": read(f"{e}LayerNorm.bias", (d,)),
    }
    f = c.intermediate_size
    for i in range(c.num_layers):
        p = f"{prefix}encoder.layer.{i}."
        for j, name in enumerate(("query", "key", "value")):
            layers["wqkv"][i, j] = read(f"{p}attention.self.{name}.weight", (d, d))
            layers["bqkv"][i, j] = read(f"{p}attention.self.{name}.bias", (d,))
        for leaf, hf, shape in (
            ("wo", "attention.output.dense.weight", (d, d)),
            ("bo", "attention.output.dense.bias", (d,)),
            ("ln1_w", "attention.output.LayerNorm.weight", (d,)),
            ("ln1_b", "attention.output.LayerNorm.bias", (d,)),
            ("w_in", "intermediate.dense.weight", (f, d)),
            ("b_in", "intermediate.dense.bias", (f,)),
            ("w_out", "output.dense.weight", (d, f)),
            ("b_out", "output.dense.bias", (d,)),
            ("ln2_w", "output.LayerNorm.weight", (d,)),
            ("ln2_b", "output.LayerNorm.bias", (d,)),
        ):
            layers[leaf][i] = read(p + hf, shape)
    host["layers"] = layers
    if c.classifier:
        if c.pooler:  # BERT's pooler (dense + tanh on [CLS]), then the classifier
            dense, out = f"{c.checkpoint_prefix}pooler.dense", "classifier"
        else:  # RobertaClassificationHead
            dense, out = "classifier.dense", "classifier.out_proj"
        host["head_dense_w"] = read(f"{dense}.weight", (d, d))
        host["head_dense_b"] = read(f"{dense}.bias", (d,))
        host["head_out_w"] = read(f"{out}.weight", (c.num_labels, d))
        host["head_out_b"] = read(f"{out}.bias", (c.num_labels,))
    return host


def _linear(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    # x [B, S, K], w [N, K], b [N] -> [B, S, N]
    return jnp.einsum("bsk,nk->bsn", x, w, preferred_element_type=jnp.float32).astype(
        x.dtype
    ) + b.astype(x.dtype)


def positions_for(config: EncoderConfig, tokens: jax.Array) -> jax.Array:
    """Each token's row of the position table: j for BERT; for RoBERTa, counted over the
    non-padding tokens from ``pad_token_id + 1``, padding at ``pad_token_id`` (transformers'
    ``create_position_ids_from_input_ids``). tokens int32 [B, S] -> int32 [B, S]."""
    if config.position_offset == 0:
        return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    real = (tokens != config.pad_token_id).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real + config.pad_token_id


def encode(
    params: Params,
    config: EncoderConfig,
    tokens: jax.Array,  # int32 [B, S], padded on the right
    mask: jax.Array,  # bool [B, S], True for real tokens
    token_types: jax.Array,  # int32 [B, S]: segment of each token (0, or 1 for a pair's second)
) -> jax.Array:  # [B, S, D] the last layer's hidden states
    """The encoder's forward: every token attends to every real token of its sequence."""
    c = config
    x = (
        params["word_embed"][tokens]
        + params["pos_embed"][positions_for(c, tokens)]
        + params["type_embed"][token_types]
    )
    x = layer_norm(x, params["embed_ln_w"], params["embed_ln_b"], c.layer_norm_eps)
    b, s, d = x.shape
    h, hd = c.num_heads, c.head_dim
    # padding keys get the most negative float (as transformers), so a row of padding only
    # still has finite weights
    key_bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]  # [B,1,1,S]
    act = ACTIVATIONS[c.hidden_act]
    scale = 1.0 / math.sqrt(hd)

    def layer(x: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        qkv = jnp.einsum("bsk,jnk->jbsn", x, w["wqkv"], preferred_element_type=jnp.float32)
        qkv = qkv.astype(x.dtype) + w["bqkv"][:, None, None, :].astype(x.dtype)
        q, k, v = (t.reshape(b, s, h, hd) for t in qkv)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * scale + key_bias, axis=-1).astype(v.dtype)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        x = layer_norm(
            _linear(attn, w["wo"], w["bo"]) + x, w["ln1_w"], w["ln1_b"], c.layer_norm_eps
        )
        up = act(_linear(x, w["w_in"], w["b_in"]))
        x = layer_norm(
            _linear(up, w["w_out"], w["b_out"]) + x, w["ln2_w"], w["ln2_b"], c.layer_norm_eps
        )
        return x, None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return x


def classify(
    params: Params,
    hidden: jax.Array,  # [B, S, D]
) -> jax.Array:  # float32 [B, C]
    """A cross-encoder's logits: out(tanh(dense(hidden of the first token)))."""
    first = hidden[:, 0].astype(jnp.float32)
    pooled = jnp.tanh(first @ params["head_dense_w"].T.astype(jnp.float32) + params["head_dense_b"])
    return pooled @ params["head_out_w"].T.astype(jnp.float32) + params["head_out_b"]


class BertEncoder(nnx.Module):
    """BERT / RoBERTa / XLM-R encoder (and its classification head); the state is the params
    tree of the module docstring."""

    def __init__(self, config: EncoderConfig, *, dtype: Any = jnp.float32) -> None:
        self.config = config
        shapes = param_shapes(config)
        self.layers = StackedParams(shapes["layers"], dtype, ones=("ln1_w", "ln2_w"))
        for name, shape in shapes.items():
            if name != "layers":
                init = jnp.ones if name == "embed_ln_w" else jnp.zeros
                setattr(self, name, nnx.Param(init(shape, dtype)))

    @classmethod
    def graphdef_for(cls, config: EncoderConfig, params: Params) -> nnx.GraphDef:
        del params
        return nnx.graphdef(nnx.eval_shape(lambda: cls(config)))

    def params(self) -> Params:
        """The params tree of the module docstring (device arrays)."""
        out = {k: v.get_value() for k, v in vars(self).items() if isinstance(v, nnx.Variable)}
        return {**out, "layers": self.layers.arrays()}

    def __call__(
        self,
        tokens: jax.Array,  # int32 [B, S]
        mask: jax.Array,  # bool [B, S]
        token_types: jax.Array,  # int32 [B, S]
    ) -> jax.Array:  # [B, S, D]
        return encode(self.params(), self.config, tokens, mask, token_types)

    def classify(self, hidden: jax.Array) -> jax.Array:  # [B, S, D] -> float32 [B, C]
        return classify(self.params(), hidden)


def _refused(config: ModelConfig) -> Mapping[str, str]:
    del config
    why = "the encoder family runs float weights on one device"
    return {
        "tensor_parallel": why,
        "lora": why,
        "quantization": why,
        "prequantized": why,
        "gguf_quantized": "jaxpaged imports no encoder GGUF layout",
    }


FAMILY = ModelFamily(
    name="bert",
    architectures=(
        "BertModel",
        "RobertaModel",
        "XLMRobertaModel",
        *_CLASSIFIERS,
    ),
    model_types=tuple(VARIANTS),
    parse_config=parse_config,
    module=BertEncoder,
    param_shapes=param_shapes,
    load_host_params=load_host_params,
    refused=_refused,
    runner="pooling",
)
