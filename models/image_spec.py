"""What a vision-language family tells the serving side about its images (`ImageSpec`):
the pixels its encoder takes and how a prompt stands for an image. A config that carries
one (``config.image``) is a model that takes images; the engine reads nothing else of the
family to serve them."""

from __future__ import annotations

import dataclasses


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
