"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): the Gemma 3 text decoder of
models/gemma.py, a SigLIP vision tower (models/siglip.py) and Gemma 3's multimodal
projector, which average-pools the tower's patch grid down to ``mm_tokens_per_image``
tokens, RMS-normalizes them (Gemma's 1 + weight) and projects them to the text width.

The prompt holds ``mm_tokens_per_image`` image-token placeholders per image; the decoder
takes their rows from the projected image features instead of the embedding table (after
the sqrt(hidden) scaling, which image features do not get, as in transformers).

The params tree is the text model's plus ``"vision"`` (the SigLIP tree) and
``"projector": {"norm": [Dv], "proj": [Dv, D]}``. Checkpoints name the parts either as
Google published them (``language_model.model.``, ``vision_tower.vision_model.``,
``multi_modal_projector.``) or as transformers 5 writes them (``model.language_model.``,
``model.vision_tower.``); both load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .family import ModelFamily
from .gemma import GemmaForCausalLM, gemma_config_fields, gemma_rms_norm
from .gemma import load_host_params as load_text_params
from .gemma import param_shapes as text_shapes
from .image_spec import ImageSpec
from .layers import dense_causal_attention, grouped_attention
from .llama import LINEARS
from .safetensors_index import TensorError
from .siglip import SiglipConfig, load_siglip, parse_siglip_config, siglip_encode, siglip_shapes
from .types import AttentionFn, Params, TensorReader

MODEL_TYPE = "gemma3"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3VLConfig(ModelConfig):
    """A Gemma 3 text config plus its vision tower and projector."""

    vision: SiglipConfig
    image: ImageSpec

    @property
    def image_feature_shape(self) -> tuple[int, int]:
        """[tokens per image, hidden]: one image's projected features."""
        return (self.image.tokens_per_image, self.hidden_size)


def parse_config(d: Mapping[str, Any]) -> Gemma3VLConfig:
    if not d.get("text_config") or not d.get("vision_config"):
        raise ValueError(
            "gemma3 config.json needs text_config and vision_config (a text-only Gemma 3 is "
            "model_type gemma3_text, Gemma3ForCausalLM)"
        )
    text = dict(d["text_config"])
    text.setdefault("model_type", "gemma3_text")
    if text["model_type"] != "gemma3_text":
        raise ValueError(f"unsupported gemma3 text_config model_type {text['model_type']!r}")
    vision_d = d.get("vision_config") or {}
    if vision_d.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(f"unsupported gemma3 vision_config model_type {vision_d['model_type']!r}")
    vision = parse_siglip_config(vision_d)
    tokens = int(d.get("mm_tokens_per_image", 256))
    side = int(round(tokens**0.5))
    if side * side != tokens or vision.patches_per_side % side:
        raise ValueError(
            f"gemma3: mm_tokens_per_image {tokens} must be a square whose side divides the "
            f"{vision.patches_per_side} patches per side"
        )
    fields = gemma_config_fields(text)
    eos = d.get("eos_token_id")
    if eos is not None:  # the top-level config's EOS, as generate reads it
        fields["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
    image_token = d.get("image_token_index", d.get("image_token_id", 262144))
    fields["model_type"] = MODEL_TYPE
    if "tie_word_embeddings" in d:
        fields["tie_word_embeddings"] = bool(d["tie_word_embeddings"])
    return Gemma3VLConfig(
        **fields,
        vision=vision,
        image=ImageSpec(
            size=vision.image_size,
            tokens_per_image=tokens,
            image_token_id=image_token,
            bidirectional=True,
        ),
    )


def param_shapes(config: Gemma3VLConfig) -> dict[str, Any]:
    dv = config.vision.hidden_size
    return {
        **text_shapes(config),
        "vision": siglip_shapes(config.vision),
        "projector": {"norm": (dv,), "proj": (dv, config.hidden_size)},
    }


def project(
    params: Mapping[str, Any],  # {"norm": [Dv], "proj": [Dv, D]}
    hidden: jax.Array,  # [N, P, Dv] the tower's last hidden states
    config: Gemma3VLConfig,
) -> jax.Array:  # [N, tokens_per_image, D]
    """Gemma 3's multimodal projector: average pool of the patch grid, norm, projection."""
    n, p, dv = hidden.shape
    side = config.vision.patches_per_side
    out = int(round(config.image.tokens_per_image**0.5))
    k = side // out
    grid = hidden.reshape(n, out, k, out, k, dv).astype(jnp.float32).mean(axis=(2, 4))
    pooled = grid.reshape(n, out * out, dv).astype(hidden.dtype)
    normed = gemma_rms_norm(pooled, params["norm"], config.vision.layer_norm_eps)
    return jnp.einsum("ntv,vd->ntd", normed, params["proj"]).astype(hidden.dtype)


class ParamTree(nnx.Module):
    """Replicated params from a nested dict of shapes (zeros), read back as that dict."""

    def __init__(self, shapes: Mapping[str, Any], dtype: Any) -> None:
        for name, shape in shapes.items():
            value = ParamTree(shape, dtype) if isinstance(shape, Mapping) else None
            setattr(self, name, value or nnx.Param(jnp.zeros(shape, dtype)))

    def tree(self) -> dict[str, Any]:
        return {
            k: v.tree() if isinstance(v, ParamTree) else jnp.asarray(v.get_value())
            for k, v in vars(self).items()
            if isinstance(v, ParamTree | nnx.Variable)
        }


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """The Gemma 3 decoder with the vision tower and projector beside it: ``encode_images``
    is the encoder (run as its own program), ``__call__`` takes the features in place of
    the image placeholders' embeddings (``image_embeds``)."""

    model_types = (MODEL_TYPE,)

    def __init__(
        self, config: Gemma3VLConfig, *, dtype: Any = jnp.float32, lm_head: bool = False
    ) -> None:
        super().__init__(config, dtype=dtype, lm_head=lm_head)
        shapes = param_shapes(config)
        self.vision = ParamTree(shapes["vision"], dtype)
        self.projector = ParamTree(shapes["projector"], dtype)

    def __call__(
        self,
        tokens: jax.Array,  # int32 [T]
        positions: jax.Array,  # int32 [T]
        attention_fn: AttentionFn = dense_causal_attention,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[jax.Array, Any]:
        """The decoder (GemmaForCausalLM's call). A dense forward (the default
        ``attention_fn``) with ``image_embeds`` lets each image's placeholders attend to each
        other both ways, as the paged engine does (its steps' causal limits) and transformers
        with ``token_type_ids``."""
        image_embeds = kwargs.get("image_embeds")
        if image_embeds is not None and attention_fn is dense_causal_attention:
            attention_fn = dense_image_attention(image_span_limits(image_embeds[1]))
        return super().__call__(tokens, positions, attention_fn, cache, **kwargs)

    def encode_images(self, pixels: jax.Array) -> jax.Array:  # [N, C, H, W] -> [N, I, D]
        """The projected features of a batch of normalized images."""
        c = self.config
        hidden = siglip_encode(self.vision.tree(), pixels, c.vision)
        return project(self.projector.tree(), hidden, c)


def image_span_limits(mask: jax.Array) -> jax.Array:  # bool [T] -> int32 [T]
    """Each position's last visible key in a dense forward: the last of its run of image
    placeholders (transformers' groups: consecutive image tokens), else itself."""
    t = mask.shape[0]
    idx = jnp.arange(t, dtype=jnp.int32)
    first_text_after = jax.lax.cummin(jnp.where(mask, t, idx), reverse=True)
    return jnp.where(mask, first_text_after - 1, idx)


def dense_image_attention(limits: jax.Array) -> AttentionFn:  # limits: int32 [T]
    """A dense forward's AttentionFn where row t sees keys up to ``limits[t]`` (the window,
    if any, bounds it below relative to t), as the paged kernels' ``causal_limits``."""

    def attention(q, k, v, layer, cache, *, sm_scale=None, sliding_window=None,
                  soft_cap=None, alibi_slopes=None):  # fmt: skip
        if alibi_slopes is not None:
            raise ValueError("Gemma 3 takes no ALiBi slopes")
        pos = jnp.arange(q.shape[0])
        mask = pos[None, :] <= limits[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - sliding_window
        return grouped_attention(q, k, v, mask, sm_scale=sm_scale, soft_cap=soft_cap), cache

    return attention


def _first_prefix(read: TensorReader, candidates: tuple[str, ...], probe: str, shape) -> str:
    """The first checkpoint prefix under which ``probe`` exists (TensorError naming all)."""
    errors = []
    for prefix in candidates:
        try:
            read(prefix + probe, shape)
            return prefix
        except TensorError as e:
            errors.append(str(e))
    raise TensorError("; ".join(errors))


_TEXT = ("language_model.model.", "model.language_model.", "language_model.")
_VISION = ("vision_tower.vision_model.", "model.vision_tower.vision_model.",
           "model.vision_tower.", "vision_tower.")  # fmt: skip
_PROJ = ("multi_modal_projector.", "model.multi_modal_projector.")


def load_host_params(
    read: TensorReader, config: Gemma3VLConfig, layers: dict[str, Any]
) -> dict[str, Any]:
    d = config.hidden_size
    text = _first_prefix(read, _TEXT, "norm.weight", (d,))
    text_read = lambda name, shape: read(text + name.removeprefix("model."), shape)  # noqa: E731
    host = load_text_params(text_read, config, layers)
    dv = config.vision.hidden_size
    vision = _first_prefix(read, _VISION, "post_layernorm.weight", (dv,))
    proj = _first_prefix(read, _PROJ, "mm_soft_emb_norm.weight", (dv,))
    probe = read(proj + "mm_input_projection_weight", (dv, d))
    return {
        **host,
        "vision": load_siglip(read, config.vision, vision, probe.dtype),
        "projector": {"norm": read(proj + "mm_soft_emb_norm.weight", (dv,)), "proj": probe},
    }


def _refused(config: ModelConfig) -> Mapping[str, str]:
    why = "not implemented for the vision tower (models/gemma3_vl.py)"
    return {
        "tensor_parallel": why,
        "lora": why,
        "quantization": why,
        "prequantized": why,
        "gguf_quantized": why,
    }


def encode_images_fn(config: Gemma3VLConfig):
    """``(params, pixels [N, C, H, W]) -> features [N, I, D]`` over the params tree."""

    def encode(params: Params, pixels: jax.Array) -> jax.Array:
        hidden = siglip_encode(params["vision"], pixels, config.vision)
        return project(params["projector"], hidden, config)

    return encode


FAMILY = ModelFamily(
    name="gemma3_vl",
    architectures=("Gemma3ForConditionalGeneration",),
    model_types=(MODEL_TYPE,),
    parse_config=parse_config,
    module=Gemma3ForConditionalGeneration,
    param_shapes=param_shapes,
    load_host_params=load_host_params,
    linears=LINEARS,
    refused=_refused,
)

__all__ = [
    "FAMILY",
    "Gemma3ForConditionalGeneration",
    "Gemma3VLConfig",
    "ImageSpec",
    "encode_images_fn",
]
