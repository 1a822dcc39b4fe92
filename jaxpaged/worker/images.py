"""The image encoder of a vision-language model and its cache, on the device.

Encoded images live in one device array of ``slots`` image-feature slots, ``[C, I, D]``
(I: tokens per image, D: the decoder's width), filled by the encoder program (its own
jitted function, compiled at warm-up for each of a few batch sizes: powers of two up to
``max_batch`` images). A host map from content hash to slot makes it a cache: an image the
cache still holds (a multi-turn chat resends it, or a recompute after a preemption) is not
encoded again; a slot is reused least recently used first, never while the current step
reads it.

Each step, :meth:`ImageEncoder.rows` gives every token row the flat index ``slot * I + j``
of its features (j: its placeholder's index in its image), or -1 for a text token; the step
gathers the features by it (``StepBatch.image_rows``). Chunked prefill may split an image's
placeholders across steps: each row is looked up on its own.

When the model attends over an image's tokens both ways (``ImageItem.whole``; the scheduler
then feeds each image in one chunk), :meth:`ImageEncoder.causal_limits` gives each row the
last key position it sees (``StepBatch.causal_limits``): its image's last for a placeholder,
its own position for any other row. Such a model's steps always carry them, text-only ones
too, so every step runs the same compiled programs.

Slots: a step reads at most ``min(S * limit, T // I + S)`` images (S sequences with at most
``limit`` images each, T tokens), so at least that many slots are kept; more keep more
images cached.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.kernels import LIMITLESS_BACKENDS
from jaxpaged.sched.images import ImageItem
from jaxpaged.sched.output import ScheduledSeq, SchedulerOutput
from jaxpaged.worker.buckets import pow2_ladder
from jaxpaged.worker.engine_jit import engine_jit

__all__ = ["ImageEncoder", "min_image_slots"]


def min_image_slots(
    *, max_num_seqs: int, max_num_batched_tokens: int, tokens_per_image: int, limit: int
) -> int:
    """The most distinct images one step can read (each feeding at least one token)."""
    return min(max_num_seqs * limit, -(-max_num_batched_tokens // tokens_per_image) + max_num_seqs)


@functools.partial(engine_jit, static_argnames=("graphdef",), donate_argnums=(1,))
def encode_into(
    params: Any,  # the model's state
    cache: jax.Array,  # [C, I, D]
    pixels: jax.Array,  # float32 [B, C_in, H, W]
    slots: jax.Array,  # int32 [B]; -1: padding (not written)
    *,
    graphdef: Any,  # StaticGraph of a module with ``encode_images``
) -> jax.Array:  # [C, I, D]
    """Encodes a batch of images into their cache slots."""
    model = nnx.merge(graphdef.graphdef, params)
    feats = model.encode_images(pixels).astype(cache.dtype)  # [B, I, D]
    where = jnp.where(slots >= 0, slots, cache.shape[0])  # out of bounds: dropped
    return cache.at[where].set(feats, mode="drop")


class ImageEncoder:
    """The encoder cache and the runner's view of each running request's images. Not
    thread-safe: the engine thread alone calls it."""

    def __init__(
        self,
        *,
        graphdef: Any,  # the step's StaticGraph (a module with ``encode_images``)
        feature_shape: tuple[int, int],  # (I, D)
        pixel_shape: tuple[int, ...],  # (C_in, H, W)
        dtype: Any,
        slots: int,
        max_batch: int = 8,
        bidirectional: bool = False,  # ImageSpec.bidirectional: steps carry causal limits
        attention_backend: str = "xla",  # the step's: one that takes causal limits if so
    ) -> None:
        if bidirectional and attention_backend in LIMITLESS_BACKENDS:
            raise ValueError(
                f"images: the {attention_backend!r} attention backend cannot attend over an "
                "image's tokens both ways, as this model does; use the 'cpu' or 'xla' backend"
            )
        self.bidirectional = bidirectional
        self.graphdef = graphdef
        self.tokens_per_image, width = feature_shape
        self.pixel_shape = tuple(pixel_shape)
        self.num_slots = slots
        self.cache = jnp.zeros((slots, self.tokens_per_image, width), dtype)
        self.batch_sizes = pow2_ladder(1, min(max_batch, slots))
        self.program = encode_into.fresh()
        self._slot_of: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU
        self._free = list(range(slots - 1, -1, -1))
        self._images: dict[str, tuple[ImageItem, ...]] = {}  # request id -> its images
        # counters (EngineStats' mm_*): a step's distinct images are its queries
        self.num_encoded = 0  # images run through the encoder (cache misses)
        self.num_hits = 0  # (step, image) pairs whose image was already encoded
        self.num_evictions = 0  # slots taken back from an encoded image for another
        self.encoder_seconds = 0.0  # wall time of the encoder programs, waited for

    def clear(self) -> None:
        """Forgets every encoded image (new weights encode differently)."""
        self._slot_of.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    # ------------------------------------------------------------- requests
    def update(self, plan: SchedulerOutput) -> None:
        """Keeps the images of the plan's new requests and forgets those that left."""
        for rid in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self._images.pop(rid, None)
        for data in plan.new_requests:
            if data.images:
                self._images[data.request_id] = data.images
            else:
                self._images.pop(data.request_id, None)

    # ------------------------------------------------------------- one step
    def rows(self, params: Any, seqs: Sequence[ScheduledSeq], num_rows: int) -> np.ndarray:
        """Each token row's feature index in the cache (int32 [num_rows], -1: none),
        encoding (with ``params``, the runner's) the images the step reads that the cache
        lacks."""
        out = np.full(num_rows, -1, np.int32)
        spans = []  # (the sequence's first row, its first and past-last positions, image)
        at = 0
        for seq in seqs:
            images = self._images.get(seq.request_id)
            if images:
                lo, hi = seq.start_pos, seq.start_pos + seq.num_tokens
                spans += [(at, lo, hi, im) for im in images if im.offset < hi and im.end > lo]
            at += seq.num_tokens
        if not spans:
            return out
        needed = list({im.content_hash: im for *_, im in spans}.values())
        if len(needed) > self.num_slots:
            raise RuntimeError(
                f"a step reads {len(needed)} images and the encoder cache holds "
                f"{self.num_slots}: the engine sized it too small"
            )
        self._ensure(params, needed)
        per = self.tokens_per_image
        for first, lo, hi, im in spans:
            a, b = max(im.offset, lo), min(im.end, hi)  # the positions this step feeds
            base = self._slot_of[im.content_hash] * per - im.offset
            out[first + a - lo : first + b - lo] = np.arange(a, b, dtype=np.int32) + base
        return out

    def causal_limits(self, seqs: Sequence[ScheduledSeq], num_rows: int) -> np.ndarray:
        """Each token row's last visible key position (int32 [num_rows]; padding rows 0):
        the last placeholder of its ``whole`` image for an image's row, else its own
        position."""
        out = np.zeros(num_rows, np.int32)
        at = 0
        for seq in seqs:
            lo, hi = seq.start_pos, seq.start_pos + seq.num_tokens
            mine = out[at : at + seq.num_tokens]
            mine[:] = np.arange(lo, hi, dtype=np.int32)
            for im in self._images.get(seq.request_id, ()):
                a, b = max(im.offset, lo), min(im.end, hi)
                if im.whole and a < b:
                    mine[a - lo : b - lo] = im.end - 1
            at += seq.num_tokens
        return out

    def _ensure(self, params: Any, images: Sequence[ImageItem]) -> None:
        """Every image in the cache; the missing ones encoded, the hits marked recent."""
        keep = {im.content_hash for im in images}
        missing = []
        for im in images:
            if im.content_hash in self._slot_of:
                self._slot_of.move_to_end(im.content_hash)
                self.num_hits += 1
            else:
                missing.append(im)
        todo: list[tuple[ImageItem, int]] = []
        for im in missing:
            todo.append((im, self._take(keep)))
            self._slot_of[im.content_hash] = todo[-1][1]
        biggest = self.batch_sizes[-1]
        for i in range(0, len(todo), biggest):
            self._encode(params, todo[i : i + biggest])
        self.num_encoded += len(todo)

    def _take(self, keep: set[str]) -> int:
        if self._free:
            return self._free.pop()
        for h in self._slot_of:  # least recently used first
            if h not in keep:
                self.num_evictions += 1
                return self._slot_of.pop(h)
        raise RuntimeError("the encoder cache has no slot to reuse")  # rows() bounds this

    def _encode(self, params: Any, todo: Sequence[tuple[ImageItem, int]]) -> None:
        n = next(b for b in self.batch_sizes if b >= len(todo))
        pixels = np.zeros((n, *self.pixel_shape), np.float32)
        slots = np.full(n, -1, np.int32)
        for i, (im, slot) in enumerate(todo):
            if tuple(im.pixels.shape) != self.pixel_shape:
                raise ValueError(
                    f"image pixels of shape {tuple(im.pixels.shape)}, the encoder takes "
                    f"{self.pixel_shape}"
                )
            pixels[i], slots[i] = im.pixels, slot
        start = time.perf_counter()  # a miss waits for its encoder (one sync, for the metric)
        self.cache = self.program(params, self.cache, pixels, slots, graphdef=self.graphdef)
        jax.block_until_ready(self.cache)
        self.encoder_seconds += time.perf_counter() - start

    def stats(self) -> dict[str, float | int]:
        """The encoder cache's counters under EngineStats' names (vLLM's mm_cache_*: one
        query per distinct image a step reads)."""
        return {
            "mm_cache_queries": self.num_hits + self.num_encoded,
            "mm_cache_hits": self.num_hits,
            "mm_cache_evictions": self.num_evictions,
            "mm_encoder_seconds": self.encoder_seconds,
        }

    def warm_up(self, params: Any) -> int:
        """Compiles the encoder for every batch size; returns how many programs."""
        for n in self.batch_sizes:
            pixels = np.zeros((n, *self.pixel_shape), np.float32)
            slots = np.full(n, -1, np.int32)
            self.cache = self.program(params, self.cache, pixels, slots, graphdef=self.graphdef)
        jax.block_until_ready(self.cache)
        return len(self.batch_sizes)
