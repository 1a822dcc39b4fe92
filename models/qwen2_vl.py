"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): the Qwen2 decoder of models/llama.py
with multimodal rotary positions (M-RoPE), and the windowed vision transformer of
models/qwen_vit.py as its image encoder.

M-RoPE: each token has three positions (temporal, height, width); the rotary pairs of a
head are split by ``mrope_section`` (summing to head_dim / 2) and pair i turns with the
position of its section. Text tokens have all three equal; an image's tokens have the
position where the image starts as temporal position and that plus their row (column) in
the image's merged grid as height (width); the text after an image continues from the
image's largest position + 1 (transformers' ``get_rope_index``; :func:`mrope_positions`).
The decoder body is Llama's, fed per-pair positions ``[T, head_dim / 2]``.

The params tree is the Qwen2 decoder's plus ``"vision"`` (models/qwen_vit.py). Checkpoints
name the parts as Qwen published them (``model.layers.``, ``visual.``) or with
transformers 5's inner names (``model.language_model.``, ``model.visual.``); both load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .family import ModelFamily
from .gemma3_vl import ParamTree, _first_prefix
from .image_spec import PatchImageSpec
from .layers import dense_causal_attention
from .llama import LINEARS, LlamaForCausalLM
from .llama import param_shapes as text_shapes
from .llama_layout import config_fields
from .llama_layout import load_host_params as load_text_params
from .qwen_vit import QwenVitConfig, load_vit, parse_vit_config, vit_encode, vit_shapes
from .types import AttentionFn, TensorReader

MODEL_TYPE = "qwen2_5_vl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen2VLConfig(ModelConfig):
    """A Qwen2 text config plus M-RoPE's sections, the vision tower and its images."""

    vision: QwenVitConfig
    image: PatchImageSpec
    mrope_section: tuple[int, int, int]

    @property
    def image_feature_shape(self) -> tuple[int, int]:
        """[most tokens of an image, hidden]: one encoder-cache slot."""
        return (self.image.tokens_per_image, self.hidden_size)


def parse_config(d: Mapping[str, Any]) -> Qwen2VLConfig:
    if not d.get("vision_config"):
        raise ValueError("qwen2_5_vl config.json needs vision_config")
    text = dict(d.get("text_config") or {k: v for k, v in d.items() if k != "vision_config"})
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or d.get("rope_scaling") or {})  # fmt: skip  # noqa: E501
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ("default", "mrope"):
        raise ValueError(f"unsupported qwen2_5_vl rope type {kind!r} (M-RoPE only)")
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    theta = float(text.get("rope_theta", rope.get("rope_theta", 1000000.0)))
    text.pop("rope_scaling", None)
    text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": theta})
    fields = config_fields(text)
    if len(section) != 3 or sum(section) != fields["head_dim"] // 2:
        raise ValueError(
            f"qwen2_5_vl: mrope_section {list(section)} must be three sizes summing to "
            f"head_dim / 2 = {fields['head_dim'] // 2}"
        )
    eos = d.get("eos_token_id")
    if eos is not None:  # the top-level config's EOS, as generate reads it
        fields["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
    if "tie_word_embeddings" in d:
        fields["tie_word_embeddings"] = bool(d["tie_word_embeddings"])
    fields["torch_dtype"] = fields["torch_dtype"] or d.get("torch_dtype") or d.get("dtype")
    fields["model_type"] = MODEL_TYPE
    vision = parse_vit_config(d["vision_config"])
    if vision.out_hidden_size != fields["hidden_size"]:
        raise ValueError(
            f"qwen2_5_vl: vision out_hidden_size {vision.out_hidden_size} differs from the "
            f"decoder's hidden_size {fields['hidden_size']}"
        )
    image = PatchImageSpec(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        image_token_id=int(d.get("image_token_id", 151655)),
    )
    image = image.with_pixels(image.min_pixels, image.max_pixels)
    return Qwen2VLConfig(**fields, vision=vision, image=image, mrope_section=section)


def param_shapes(config: Qwen2VLConfig) -> dict[str, Any]:
    return {**text_shapes(config), "vision": vit_shapes(config.vision)}


def mrope_positions(
    positions: np.ndarray,  # int [n]: token indices in the sequence
    images: Sequence[tuple[int, int, int, int]],  # (offset, tokens, grid rows, grid columns)
) -> np.ndarray:  # int32 [3, n]
    """The M-RoPE (temporal, height, width) positions of tokens of a sequence whose images
    sit at the given offsets (merged grid rows x columns = tokens each, in order), as
    transformers' ``get_rope_index``: an image's tokens at (s, s + row, s + column) where
    s is the position the image starts at; text (and every token after the prompt) at its
    index plus the shift of the images before it (each advances the positions by
    max(rows, columns) instead of its token count)."""
    pos = np.asarray(positions, np.int64)
    out = np.broadcast_to(pos, (3, len(pos))).copy()
    shift = 0
    for offset, n, rows, cols in images:
        start = offset + shift
        inside = (pos >= offset) & (pos < offset + n)
        j = pos[inside] - offset
        out[0, inside] = start
        out[1, inside] = start + j // cols
        out[2, inside] = start + j % cols
        shift += max(rows, cols) - n
        out[:, pos >= offset + n] += max(rows, cols) - n
    return out.astype(np.int32)


def pair_positions(
    mrope: jax.Array,  # int32 [3, T]
    section: Sequence[int],
) -> jax.Array:  # int32 [T, hd / 2]
    """Each rotary pair's position: pair i takes the component of its M-RoPE section."""
    component = np.repeat(np.arange(3), section)
    return mrope[component].T


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """The Qwen2 decoder with the vision tower beside it: ``encode_patches`` is the encoder
    (run as its own program); ``__call__`` takes M-RoPE positions and the image features
    in place of the placeholders' embeddings."""

    model_types = (MODEL_TYPE,)

    def __init__(
        self, config: Qwen2VLConfig, *, dtype: Any = jnp.float32, lm_head: bool | None = None
    ) -> None:
        super().__init__(config, dtype=dtype, lm_head=lm_head)
        self.vision = ParamTree(vit_shapes(config.vision), dtype)

    def __call__(
        self,
        tokens: jax.Array,  # int32 [T]
        positions: jax.Array,  # int32 [T]
        attention_fn: AttentionFn = dense_causal_attention,
        cache: Any = None,
        *,
        mrope_positions: jax.Array | None = None,  # int32 [3, T]
        **kwargs: Any,
    ) -> tuple[jax.Array, Any]:
        """LlamaForCausalLM's forward with each rotary pair at its M-RoPE position
        (``mrope_positions``; None: text only, all three equal to ``positions``);
        ``image_embeds``: (features [T, D], bool [T]) in place of the masked rows'
        embeddings."""
        if mrope_positions is not None:
            positions = pair_positions(mrope_positions, self.config.mrope_section)
        return super().__call__(tokens, positions, attention_fn, cache, **kwargs)

    def encode_patches(
        self,
        patches: jax.Array,  # float32 [P, K]
        positions: jax.Array,  # int32 [P, 2]
        full_ids: jax.Array,  # int32 [P]
        window_ids: jax.Array,  # int32 [P]
    ) -> jax.Array:  # [P / 4, D], in window order (models/qwen_vit.py pack_images)
        return vit_encode(
            self.vision.tree(), patches, positions, full_ids, window_ids, self.config.vision
        )


_TEXT = ("model.", "model.language_model.")
_VISION = ("visual.", "model.visual.")


def load_host_params(
    read: TensorReader, config: Qwen2VLConfig, layers: dict[str, Any]
) -> dict[str, Any]:
    d = config.hidden_size
    text = _first_prefix(read, _TEXT, "norm.weight", (d,))

    def text_read(name: str, shape: tuple[int, ...]) -> Any:
        inner = name.removeprefix("model.")
        return read(text + inner if inner != name else name, shape)

    host = load_text_params(text_read, config, layers)
    dv = config.vision.hidden_size
    vision = _first_prefix(read, _VISION, "merger.ln_q.weight", (dv,))
    dtype = host["final_norm"].dtype
    return {**host, "vision": load_vit(read, config.vision, vision, dtype)}


def _refused(config: ModelConfig) -> Mapping[str, str]:
    why = "not implemented for the vision tower (models/qwen2_vl.py)"
    return {
        "tensor_parallel": why,
        "lora": why,
        "quantization": why,
        "prequantized": why,
        "gguf_quantized": why,
    }


FAMILY = ModelFamily(
    name="qwen2_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    model_types=(MODEL_TYPE,),
    parse_config=parse_config,
    module=Qwen2VLForConditionalGeneration,
    param_shapes=param_shapes,
    load_host_params=load_host_params,
    linears=LINEARS,
    refused=_refused,
)

__all__ = [
    "FAMILY",
    "Qwen2VLConfig",
    "Qwen2VLForConditionalGeneration",
    "mrope_positions",
    "pair_positions",
]
