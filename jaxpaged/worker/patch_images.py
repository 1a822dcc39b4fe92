"""The encoder cache of a model whose images come at their own size (Qwen2.5-VL,
:class:`~jaxpaged.models.image_spec.PatchImageSpec`), and its M-RoPE positions.

The cache is :class:`~jaxpaged.worker.images.ImageEncoder`'s: slots of ``I`` feature rows
(``I``: the largest image's tokens), found by content hash, least recently used reused
first, each token row looked up by its flat index ``slot * I + j``; an image of n tokens
fills the first n rows of its slot. What differs is the encoder program: the missing
images' patches are packed into one run of P patches (models/qwen_vit.py ``pack_images``,
images split by attention masks, windows reordered on the host), P one of a few powers of
two up to the largest image's patch count, each compiled at warm-up; the program writes each
merged output row to its slot row (the window order's inverse), padding rows nowhere. Any
mix of image sizes therefore runs through the warm-up's programs.

:meth:`PatchImageEncoder.mrope_positions` gives each token row its three M-RoPE positions
(models/qwen2_vl.py ``mrope_positions``) from its request's images, for prefill chunks and
decode rows alike (a decode row's position plus the shift its prompt's images add, as
vLLM's ``mrope_position_delta``), so the step's inputs keep their shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.qwen2_vl import mrope_positions
from jaxpaged.models.qwen_vit import QwenVitConfig, pack_images
from jaxpaged.sched.images import ImageItem
from jaxpaged.sched.output import ScheduledSeq
from jaxpaged.worker.buckets import pow2_ladder
from jaxpaged.worker.engine_jit import engine_jit
from jaxpaged.worker.images import ImageEncoder

__all__ = ["PatchImageEncoder", "image_encoder"]

_SMALLEST = 64  # the smallest encoder input, in patches


@functools.partial(engine_jit, static_argnames=("graphdef",), donate_argnums=(1,))
def encode_patches_into(
    params: Any,  # the model's state
    cache: jax.Array,  # [C, I, D]
    patches: jax.Array,  # float32 [P, K]
    positions: jax.Array,  # int32 [P, 2]
    full_ids: jax.Array,  # int32 [P]
    window_ids: jax.Array,  # int32 [P]
    dest: jax.Array,  # int32 [P / 4] each output row's flat cache row, -1: not written
    *,
    graphdef: Any,  # StaticGraph of a module with ``encode_patches``
) -> jax.Array:  # [C, I, D]
    """Encodes packed images into their cache rows."""
    model = nnx.merge(graphdef.graphdef, params)
    feats = model.encode_patches(patches, positions, full_ids, window_ids).astype(cache.dtype)
    flat = cache.reshape(-1, cache.shape[-1])
    where = jnp.where(dest >= 0, dest, flat.shape[0])  # out of bounds: dropped
    return flat.at[where].set(feats, mode="drop").reshape(cache.shape)


class PatchImageEncoder(ImageEncoder):
    """ImageEncoder for images of their own size, packed by patches. Not thread-safe."""

    def __init__(
        self,
        *,
        graphdef: Any,
        feature_shape: tuple[int, int],  # (I, D)
        vision: QwenVitConfig,
        dtype: Any,
        slots: int,
    ) -> None:
        self.vision = vision
        most = feature_shape[0] * vision.merge_unit  # the largest image's patches
        super().__init__(
            graphdef=graphdef,
            feature_shape=feature_shape,
            pixel_shape=(most, vision.patch_dim),
            dtype=dtype,
            slots=slots,
            max_batch=1,
        )
        self.patch_buckets = pow2_ladder(min(_SMALLEST, most), most)
        # _ensure hands _encode this many images at a time: all of them (packed here)
        self.batch_sizes = (slots,)
        self.program = encode_patches_into.fresh()

    def _encode(self, params: Any, todo: Sequence[tuple[ImageItem, int]]) -> None:
        most = self.patch_buckets[-1]
        group: list[tuple[ImageItem, int]] = []
        for im, slot in todo:
            n = im.pixels.shape[0]
            if n > most or im.grid is None:
                raise ValueError(f"image of {n} patches; the encoder takes at most {most}")
            if sum(g.pixels.shape[0] for g, _ in group) + n > most:
                self._run(params, group)
                group = []
            group.append((im, slot))
        if group:
            self._run(params, group)

    def _run(self, params: Any, group: Sequence[tuple[ImageItem, int]]) -> None:
        total = sum(im.pixels.shape[0] for im, _ in group)
        size = next(b for b in self.patch_buckets if b >= total)
        packed = pack_images([(im.pixels, im.grid) for im, _ in group], size, self.vision)
        slots = np.asarray([slot for _, slot in group] + [0], np.int64)
        dest = slots[packed.image_of] * self.tokens_per_image + packed.order
        dest = np.where(packed.image_of >= 0, dest, -1).astype(np.int32)
        self._call(params, packed[:4], dest)

    def _call(self, params: Any, arrays: Sequence[np.ndarray], dest: np.ndarray) -> None:
        self.cache = self.program(params, self.cache, *arrays, dest, graphdef=self.graphdef)

    def warm_up(self, params: Any) -> int:
        """Compiles the encoder for every patch bucket; returns how many programs."""
        for n in self.patch_buckets:
            empty = pack_images([], n, self.vision)
            self._call(params, empty[:4], np.full(n // self.vision.merge_unit, -1, np.int32))
        jax.block_until_ready(self.cache)
        return len(self.patch_buckets)

    def mrope_positions(self, seqs: Sequence[ScheduledSeq], num_rows: int) -> np.ndarray:
        """Each token row's (temporal, height, width) positions, int32 [3, num_rows]
        (padding rows 0)."""
        out = np.zeros((3, num_rows), np.int32)
        m = self.vision.spatial_merge_size
        at = 0
        for seq in seqs:
            pos = np.arange(seq.start_pos, seq.start_pos + seq.num_tokens)
            images = self._images.get(seq.request_id, ())
            rows = slice(at, at + seq.num_tokens)
            at += seq.num_tokens
            grids = [(im.offset, im.length, im.grid[1] // m, im.grid[2] // m) for im in images]
            if not images or seq.start_pos >= images[-1].end:  # text after every image
                out[:, rows] = pos + sum(max(r, c) - n for _, n, r, c in grids)
            else:
                out[:, rows] = mrope_positions(pos, grids)
        return out


def image_encoder(
    model_config: Any,
    *,
    graphdef: Any,
    dtype: Any,
    slots: int,
    bidirectional: bool = False,
    attention_backend: str = "xla",
) -> ImageEncoder:
    """The encoder cache of a vision-language model's config (one with ``image``);
    ``bidirectional`` / ``attention_backend``: ImageEncoder's (Qwen2.5-VL is causal)."""
    vision = getattr(model_config, "vision", None)
    if isinstance(vision, QwenVitConfig):
        return PatchImageEncoder(
            graphdef=graphdef,
            feature_shape=model_config.image_feature_shape,
            vision=vision,
            dtype=dtype,
            slots=slots,
        )
    return ImageEncoder(
        graphdef=graphdef,
        feature_shape=model_config.image_feature_shape,
        pixel_shape=model_config.image.pixel_shape,
        dtype=dtype,
        slots=slots,
        bidirectional=bidirectional,
        attention_backend=attention_backend,
    )
