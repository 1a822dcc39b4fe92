"""An image attached to a request, as plain data the scheduler and the runner share: where
its placeholder tokens sit in the prompt, its content hash (the encoder cache's key and part
of the prefix-cache keys of the blocks holding its placeholders) and its pixels, which only
the runner reads."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["ImageItem", "content_hash", "fit_chunk", "image_key_slice"]


def content_hash(pixels: Any) -> str:  # pixels: a numpy array
    """The sha256 hex of an image's preprocessed pixels (C order) with their dtype and
    shape."""
    h = hashlib.sha256(f"{pixels.dtype.str}{tuple(pixels.shape)}".encode())
    h.update(pixels.tobytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ImageItem:
    content_hash: str  # sha256 hex of the preprocessed pixels (and their shape)
    offset: int  # the prompt position of its first placeholder token
    length: int  # how many placeholder tokens stand for it
    pixels: Any = dataclasses.field(repr=False)  # float32 [C, H, W], normalized (numpy)
    # an image at its own size (Qwen2.5-VL): pixels are its patches [N, K] and this their
    # grid (frames, rows, columns), as transformers' image_grid_thw
    grid: tuple[int, int, int] | None = None
    # its placeholders attend to each other both ways (ImageSpec.bidirectional): a prefill
    # chunk that feeds any of them feeds up to its last (``fit_chunk``)
    whole: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def key(self) -> int:
        """A negative int64 (no token id is negative) that stands for each of its
        placeholders in the prefix-cache keys: two prompts that differ only in the image
        get different keys for the blocks holding it."""
        return -1 - int(self.content_hash[:15], 16)


def fit_chunk(start: int, n: int, images: Sequence[ImageItem]) -> int:
    """The most tokens (<= ``n``) a prefill chunk from position ``start`` may feed without
    ending inside a ``whole`` image: an image's tokens see the K/V of all of its tokens, so
    the chunk that feeds one also feeds its last (the earlier ones may be in cached blocks,
    whose K/V the whole image computed). 0: the chunk starts in or at an image it cannot
    hold, so the request waits for a step with room."""
    stop = start + n
    for im in images:
        if im.whole and im.offset < stop < im.end:
            stop = im.offset if im.offset > start else start
    return stop - start


def image_key_slice(
    tokens: Sequence[int], start: int, images: Sequence[ImageItem]
) -> Sequence[int]:
    """``tokens`` (the prompt's from position ``start``) with each image placeholder
    replaced by its image's ``key``."""
    out = None
    stop = start + len(tokens)
    for im in images:
        lo, hi = max(start, im.offset), min(stop, im.end)
        if lo < hi:
            out = list(tokens) if out is None else out
            out[lo - start : hi - start] = [im.key] * (hi - lo)
    return tokens if out is None else out
