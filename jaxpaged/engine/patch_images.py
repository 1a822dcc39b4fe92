"""Images at their own size into Qwen2.5-VL's inputs (a :class:`PatchImageSpec`), in the
caller's thread, with numpy and Pillow only: the serving process never imports PyTorch,
which transformers' own processor would pull in (and its torchvision video half).

This reproduces transformers' ``Qwen2VLImageProcessorPil`` (checked against it in tests):
RGB (transparency over white), :func:`smart_resize` of the sides to multiples of
``patch_size * merge_size`` with about the image's aspect ratio and between ``min_pixels``
and ``max_pixels`` pixels, Pillow's bicubic resize, 1/255, mean/std of the checkpoint's
``preprocessor_config.json``, then :func:`patchify`: each ``merge_size`` squared group of
patches in turn, each patch's (channel, frame, row, column) values flattened, the one frame
repeated ``temporal_patch_size`` times. A prompt's ``<|image_pad|>`` (inside the chat
template's ``<|vision_start|>...<|vision_end|>``) is repeated once per token of its image:
(rows / merge) x (columns / merge) of the image's patch grid.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpaged.engine.images import ImagePrompts, image_spec_from_folder, to_rgb
from jaxpaged.models.image_spec import MAX_ASPECT, ImageSpec, PatchImageSpec
from jaxpaged.sched.images import ImageItem, content_hash

__all__ = [
    "PatchImagePrompts",
    "image_prompts",
    "image_spec_for_folder",
    "patchify",
    "preprocess_patches",
    "smart_resize",
]


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor``, scaled to hold between
    ``min_pixels`` and ``max_pixels`` pixels, as transformers' ``smart_resize``."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(
            f"image: {width} x {height} pixels; the aspect ratio must be at most {MAX_ASPECT}"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patchify(
    pixels: np.ndarray,  # float32 [C, H, W]
    spec: PatchImageSpec,
) -> np.ndarray:  # float32 [H / p * W / p, C * T * p * p]
    """Patches in merge-group order, each flattened (channel, frame, row, column)."""
    c, h, w = pixels.shape
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = h // p, w // p
    x = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p), dtype=np.float32)


def preprocess_patches(
    image: Any, spec: PatchImageSpec
) -> tuple[np.ndarray, tuple[int, int, int]]:  # (float32 [N, K], (1, rows, columns))
    """An image (PIL) as the model's patches and their grid (frames, rows, columns)."""
    from PIL import Image

    rgb = to_rgb(image)
    w, h = rgb.size
    rh, rw = smart_resize(h, w, spec.factor, spec.min_pixels, spec.max_pixels)
    rgb = rgb.resize((rw, rh), Image.Resampling.BICUBIC)
    x = np.asarray(rgb, np.float32) * np.float32(spec.rescale)
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    grid = (1, rh // spec.patch_size, rw // spec.patch_size)
    return patchify(x.transpose(2, 0, 1), spec), grid


def _num_tokens(image: Any, spec: PatchImageSpec) -> int:
    """The image's placeholder count, from its size alone (no pixel is decoded)."""
    w, h = image.size
    if w < 1 or h < 1:
        raise ValueError(f"image: {w} x {h} pixels; an image needs at least 1 x 1")
    rh, rw = smart_resize(h, w, spec.factor, spec.min_pixels, spec.max_pixels)
    n = (rh // spec.factor) * (rw // spec.factor)
    if n > spec.tokens_per_image:
        raise ValueError(
            f"image: {w} x {h} pixels resize to {rw} x {rh}, {n} tokens, more than the "
            f"{spec.tokens_per_image} an image may take (min_pixels {spec.min_pixels}, "
            f"max_pixels {spec.max_pixels})"
        )
    return n


@dataclasses.dataclass(frozen=True)
class PatchImagePrompts(ImagePrompts):
    """Image prompts whose images each take as many placeholders as their size gives."""

    spec: PatchImageSpec

    def expand(self, text: str, images: Sequence[Any] = ()) -> str:
        """The prompt text with the i-th image marker repeated once per token of image i
        (markers beyond the images are left single: :meth:`images` refuses them)."""
        parts = text.split(self.spec.boi_token)
        out = [parts[0]]
        for i, part in enumerate(parts[1:]):
            n = _num_tokens(images[i], self.spec) if i < len(images) else 1
            out += [self.spec.image_token * n, part]
        return "".join(out)

    def images(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[ImageItem, ...]:
        """The ImageItems of a tokenized prompt whose placeholders are expanded, one run per
        image in order; ValueError when they do not match."""
        if len(images) > self.limit:
            raise ValueError(
                f"multi_modal_data: {len(images)} images in one prompt, more than the limit "
                f"of {self.limit} (limit_mm_per_prompt)"
            )
        counts = [_num_tokens(image, self.spec) for image in images]
        where = np.flatnonzero(np.asarray(ids, np.int64) == self.spec.image_token_id)
        if len(where) != sum(counts):
            raise ValueError(
                f"prompt: {len(where)} image placeholder tokens for {len(images)} images "
                f"({counts} by their sizes); write {self.spec.boi_token!r} in the prompt "
                "for each image"
            )
        items, at = [], 0
        for i, (image, n) in enumerate(zip(images, counts, strict=True)):
            run = where[at : at + n]
            at += n
            if run[-1] - run[0] != n - 1:
                raise ValueError(f"prompt: the placeholders of image {i} are not contiguous")
            patches, grid = preprocess_patches(image, self.spec)
            items.append(
                ImageItem(
                    content_hash=content_hash(patches),
                    offset=int(run[0]),
                    length=n,
                    pixels=patches,
                    grid=grid,
                )
            )
        return tuple(items)


def image_prompts(spec: ImageSpec, limit: int) -> ImagePrompts:
    """The image prompts of a model's image spec."""
    if isinstance(spec, PatchImageSpec):
        return PatchImagePrompts(spec, limit)
    return ImagePrompts(spec, limit)


def image_spec_for_folder(spec: ImageSpec, folder: str | os.PathLike | None) -> ImageSpec:
    """``spec`` with the settings of the folder's image processor config (ValueError for
    one that is not reproduced); a fixed-size spec as engine/images.py reads it."""
    if not isinstance(spec, PatchImageSpec):
        return image_spec_from_folder(spec, folder)
    path = None if folder is None else os.path.join(folder, "preprocessor_config.json")
    if path is None or not os.path.isfile(path):
        return spec
    with open(path) as f:
        d = json.load(f)
    name = "preprocessor_config.json"
    size = d.get("size") or {}
    lo = d.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    hi = d.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    for key, want in (("patch_size", spec.patch_size), ("merge_size", spec.merge_size),
                      ("temporal_patch_size", spec.temporal_patch_size)):  # fmt: skip
        if int(d.get(key, want)) != want:
            raise ValueError(f"{name}: {key} {d[key]} differs from the vision tower's {want}")
    if d.get("resample", 3) != 3 or d.get("do_resize") is False:
        raise ValueError(f"{name}: only bicubic resizing (resample 3) is supported")
    normalize = d.get("do_normalize", True)
    return spec.with_pixels(
        int(lo or spec.min_pixels),
        int(hi or spec.max_pixels),
        mean=tuple(float(v) for v in d.get("image_mean", spec.mean)) if normalize else (0.0,) * 3,
        std=tuple(float(v) for v in d.get("image_std", spec.std)) if normalize else (1.0,) * 3,
        rescale=float(d.get("rescale_factor", spec.rescale)) if d.get("do_rescale", True) else 1.0,
    )
