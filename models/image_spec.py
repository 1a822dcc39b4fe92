"""What a vision-language family tells the serving side about its images (`ImageSpec`):
the pixels its encoder takes and how a prompt stands for an image. A config that carries
one (``config.image``) is a model that takes images; the engine reads nothing else of the
family to serve them."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageSpec:
    """What the serving side needs to turn an image into the model's inputs: pixels of
    ``size`` squared, normalized per channel, and how the prompt stands for one image."""

    size: int  # images are resized to size x size
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255  # pixel values are multiplied by it before normalizing
    tokens_per_image: int = 256
    image_token_id: int = 262144  # the placeholder the features replace
    boi_token: str = "<start_of_image>"  # what a prompt writes for an image
    # what the processor expands ``boi_token`` to; {image} stands for the placeholders
    expansion: str = "\n\n<start_of_image>{image}<end_of_image>\n\n"
    image_token: str = "<image_soft_token>"
    # an image's placeholders attend to each other both ways (Gemma 3: transformers' mask
    # with token_type_ids); the scheduler then keeps each image whole in one prefill chunk
    bidirectional: bool = False

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        return (3, self.size, self.size)

    @property
    def min_tokens_per_image(self) -> int:
        """The fewest placeholders an image takes (bounds the images one step reads)."""
        return self.tokens_per_image


MAX_ASPECT = 200  # transformers' smart_resize refuses images more elongated than this
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatchImageSpec(ImageSpec):
    """Images at their own size (Qwen2.5-VL): resized to the nearest multiple of
    ``patch_size * merge_size`` within [min_pixels, max_pixels] (bicubic), cut into
    ``C * temporal_patch_size * patch_size**2``-value patches, one placeholder token per
    ``merge_size``-squared group of patches. ``tokens_per_image`` is the most an image
    gets: the size of an encoder-cache slot."""

    size: int = 0  # unused: every image has its own
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    tokens_per_image: int = 1280
    image_token_id: int = 151655
    # the chat template writes <|vision_start|><|image_pad|><|vision_end|>; the processor
    # repeats <|image_pad|> once per token of the image
    boi_token: str = "<|image_pad|>"
    expansion: str = "{image}"
    image_token: str = "<|image_pad|>"

    @property
    def factor(self) -> int:
        """Image sides are multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        raise ValueError("a PatchImageSpec's images have no fixed pixel shape")

    @property
    def min_tokens_per_image(self) -> int:
        return max(self.min_pixels // self.factor**2, 1)

    def with_pixels(self, min_pixels: int, max_pixels: int, **changes) -> PatchImageSpec:
        """The spec with other pixel bounds (and ``changes``), ``tokens_per_image`` theirs."""
        spec = dataclasses.replace(self, min_pixels=min_pixels, max_pixels=max_pixels, **changes)
        if not 0 < spec.min_pixels <= spec.max_pixels:
            raise ValueError(
                f"image processor: min_pixels {min_pixels} and max_pixels {max_pixels} must "
                "satisfy 0 < min_pixels <= max_pixels"
            )
        f = spec.factor
        # smart_resize keeps a side of at least one factor, so an elongated image may pass
        # max_pixels: its long side reaches sqrt(max_pixels * aspect) at most
        most = max(spec.max_pixels // f**2, math.ceil(math.sqrt(MAX_ASPECT * spec.max_pixels) / f))
        return dataclasses.replace(spec, tokens_per_image=most)
