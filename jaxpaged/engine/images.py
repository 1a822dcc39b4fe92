"""Images into a vision-language model's inputs, in the caller's thread, with numpy and
Pillow only (no PyTorch at serve time): untrusted bytes decoded with bounds
(:func:`decode_image`), an image resized and normalized as the model's processor does
(:func:`preprocess`), and a prompt's image placeholders expanded and located
(:class:`ImagePrompts`), giving the :class:`~jaxpaged.sched.images.ImageItem` s a request
carries.

Gemma 3's processor (transformers' ``Gemma3ImageProcessorPil``, the one transformers uses
without torchvision) resizes to size x size with Pillow's bilinear filter, rescales by 1/255
and normalizes with the mean and std of ``preprocessor_config.json``; a prompt's
``<start_of_image>`` becomes ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image``
``<image_soft_token>`` + ``<end_of_image>\\n\\n``. Pan-and-scan crops are not done.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxpaged.models.image_spec import ImageSpec
from jaxpaged.sched.images import ImageItem, content_hash

__all__ = [
    "FORMATS",
    "ImagePrompts",
    "decode_image",
    "chat_images",
    "decode_data_url",
    "image_spec_from_folder",
    "preprocess",
    "split_prompt",
]

FORMATS = ("PNG", "JPEG", "WEBP")  # what decode_image accepts
MAX_IMAGE_PIXELS = 32 * 1024 * 1024  # width x height of one image, checked before decoding
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one image's encoded bytes
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp);base64,", re.IGNORECASE)


def decode_data_url(
    url: str, *, max_bytes: int = MAX_IMAGE_BYTES, fetch: Callable[[str], bytes] | None = None
) -> Any:  # PIL.Image.Image
    """The image of a ``data:image/{png,jpeg,webp};base64,...`` URL, or of an http(s) URL
    that ``fetch`` reads (None: fetching is off, refused); ValueError for another kind of
    URL, bad base64, more than ``max_bytes`` bytes, or an image :func:`decode_image`
    refuses. The error never quotes the data."""
    if not isinstance(url, str):
        raise ValueError("image_url: the url must be a string")
    m = _DATA_URL.match(url)
    if m is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "no scheme"
        if scheme.lower() in ("http", "https"):
            if fetch is None:
                raise ValueError(
                    "image_url: fetching http(s) images is disabled (the server's "
                    "--allowed-media-domains); send a data URL"
                )
            return decode_image(fetch(url))
        raise ValueError(
            "image_url: only data:image/png, image/jpeg or image/webp ;base64 URLs are "
            f"supported (got {scheme!r})"
        )
    body = url[m.end() :]
    if len(body) > (max_bytes + 2) // 3 * 4 + 4:
        raise ValueError(f"image_url: the image is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url: the data URL is not valid base64") from None
    return decode_image(data)


def chat_images(
    messages: Sequence[Mapping[str, Any]], fetch: Callable[[str], bytes] | None = None
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the messages as multimodal chat templates take them, their images in order) of chat
    messages whose content may list parts: {"type": "text", "text"}, {"type": "image_url",
    "image_url": {"url": data URL} or the URL}, {"type": "image" or "image_pil", ...: a PIL
    image}. Each image part becomes {"type": "image"}; messages without images stay as
    they are. ``fetch``: reads an http(s) image URL (None: such URLs are refused)."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list) or not any(
            isinstance(p, Mapping) and p.get("type") != "text" for p in content
        ):
            out.append(dict(m) if isinstance(m, Mapping) else m)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, Mapping) else url
                images.append(decode_data_url(url, fetch=fetch))
                parts.append({"type": "image"})
            elif kind in ("image", "image_pil"):
                images.append(part.get(kind))
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"messages[{i}].content[{j}]: unsupported part type {kind!r} (text, "
                    "image_url, image, image_pil)"
                )
        out.append({**m, "content": parts})
    return out, images


def decode_image(
    data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS, formats: Sequence[str] = FORMATS
) -> Any:  # PIL.Image.Image, decoded
    """A PNG, JPEG or WebP image from untrusted bytes; ValueError for anything else: not an
    image of those formats, 0 x 0, more than ``max_pixels`` pixels (checked from the header,
    before any pixel is decoded: a decompression bomb never expands), or truncated. Pillow's
    process-wide MAX_IMAGE_PIXELS is left as it is."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError:  # Pillow's own process-wide bound, far above ours
        raise ValueError(f"image: too many pixels, more than the limit of {max_pixels}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise ValueError(f"image: not a valid {'/'.join(formats)} image") from None
    w, h = image.size
    if w < 1 or h < 1:
        raise ValueError(f"image: {w} x {h} pixels; an image needs at least 1 x 1")
    if w * h > max_pixels:
        raise ValueError(f"image: {w} x {h} pixels is more than the limit of {max_pixels}")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise ValueError(f"image: the {image.format} data is truncated or corrupt ({e})") from None
    return image


def to_rgb(image: Any) -> Any:  # PIL.Image.Image
    """An image (PIL) in RGB, transparency composited over white (transformers'
    convert_to_rgb); ValueError for what is not an image or has no pixel."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"image must be a PIL.Image.Image, got {type(image).__name__}")
    w, h = image.size
    if w < 1 or h < 1:
        raise ValueError(f"image: {w} x {h} pixels; an image needs at least 1 x 1")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Any, spec: ImageSpec) -> np.ndarray:  # float32 [3, S, S]
    """An image (PIL) as the model's normalized pixels, channels first: RGB (transparency
    composited over white), resized, rescaled to [0, 1] and normalized."""
    from PIL import Image

    rgb = to_rgb(image)
    rgb = rgb.resize((spec.size, spec.size), Image.Resampling.BILINEAR)
    x = np.asarray(rgb, np.float32) * np.float32(spec.rescale)
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


def image_spec_from_folder(spec: ImageSpec, folder: str | os.PathLike | None) -> ImageSpec:
    """``spec`` with the size, rescale factor, mean and std of the folder's image processor
    config (preprocessor_config.json, or processor_config.json's "image_processor"), if
    any; ValueError for a setting :func:`preprocess` does not reproduce."""
    if folder is None:
        return spec
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):  # fmt: skip  # noqa: E501
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            d = json.load(f)
        d = d.get(key, {}) if key else d
        if not d:
            continue
        size = d.get("size") or {}
        side = size.get("height", size.get("shortest_edge", spec.size))
        if size.get("width", side) != side:
            raise ValueError(f"{name}: image size {size} is not square")
        if int(side) != spec.size:
            raise ValueError(
                f"{name}: image size {side} differs from the vision tower's image_size {spec.size}"
            )
        if d.get("do_pan_and_scan"):
            raise ValueError(f"{name}: do_pan_and_scan is not supported")
        if d.get("resample", 2) != 2 or d.get("do_resize") is False:
            raise ValueError(f"{name}: only bilinear resizing (resample 2) is supported")
        normalize = d.get("do_normalize", True)
        rescale = d.get("rescale_factor", spec.rescale) if d.get("do_rescale", True) else 1.0
        return dataclasses.replace(
            spec,
            size=int(side),
            mean=tuple(float(v) for v in d.get("image_mean", spec.mean))
            if normalize
            else (0.0,) * 3,
            std=tuple(float(v) for v in d.get("image_std", spec.std)) if normalize else (1.0,) * 3,
            rescale=float(rescale),
        )
    return spec


def check_chunk_room(spec: ImageSpec, max_num_batched_tokens: int, cap: int | None) -> None:
    """ValueError when a model that keeps each image in one prefill chunk
    (``spec.bidirectional``) could never fit one: the step budget, and the prefill cap of a
    step with decodes (``max_prefill_tokens_with_decodes``), must hold an image's tokens."""
    if not spec.bidirectional:
        return
    for name, value in (
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_prefill_tokens_with_decodes", cap),
    ):
        if value is not None and value < spec.tokens_per_image:
            raise ValueError(
                f"{name}={value} is below an image's {spec.tokens_per_image} tokens, which "
                "this model feeds in one prefill chunk (they attend to each other both ways)"
            )


@dataclasses.dataclass(frozen=True)
class ImagePrompts:
    """A model's image prompts: ``limit`` images per prompt at most."""

    spec: ImageSpec
    limit: int

    def expand(self, text: str, images: Sequence[Any] = ()) -> str:
        """The prompt text with each image marker (``spec.boi_token``) expanded to the
        model's placeholders, as its processor does (``images``: the prompt's, for models
        whose placeholder count depends on the image, engine/patch_images.py)."""
        full = self.spec.expansion.format(image=self.spec.image_token * self.spec.tokens_per_image)
        return text.replace(self.spec.boi_token, full)

    def images(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[ImageItem, ...]:
        """The ImageItems of a tokenized prompt whose placeholders are expanded, one run of
        ``tokens_per_image`` per image in order; ValueError when they do not match."""
        if len(images) > self.limit:
            raise ValueError(
                f"multi_modal_data: {len(images)} images in one prompt, more than the limit "
                f"of {self.limit} (limit_mm_per_prompt)"
            )
        per = self.spec.tokens_per_image
        where = np.flatnonzero(np.asarray(ids, np.int64) == self.spec.image_token_id)
        if len(where) != per * len(images):
            raise ValueError(
                f"prompt: {len(where)} image placeholder tokens for {len(images)} images "
                f"({per} each); write {self.spec.boi_token!r} in the prompt for each image"
            )
        items = []
        for i, image in enumerate(images):
            run = where[i * per : (i + 1) * per]
            if run[-1] - run[0] != per - 1:
                raise ValueError(f"prompt: the placeholders of image {i} are not contiguous")
            pixels = preprocess(image, self.spec)
            items.append(
                ImageItem(
                    content_hash=content_hash(pixels),
                    offset=int(run[0]),
                    length=per,
                    pixels=pixels,
                    whole=self.spec.bidirectional,
                )
            )
        return tuple(items)


def split_prompt(prompt: Mapping[str, Any]) -> tuple[Any, list[Any]]:
    """(text or token ids, images) of a dict prompt ``{"prompt": text}`` or
    ``{"prompt_token_ids": ids}`` with ``"multi_modal_data": {"image": image or list}``
    (and ``"add_special_tokens"``: False for a text rendered by a chat template, which
    writes them itself)."""
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "add_special_tokens"}
    if unknown:
        raise ValueError(f"prompt: unknown keys {sorted(unknown)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt: give exactly one of 'prompt' and 'prompt_token_ids'")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, Mapping) or set(data) - {"image"}:
        raise ValueError("multi_modal_data: only {'image': image or list of images} is supported")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    body = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    return body, images
