"""The pooling runner's device side: an encoder over fixed-shape padded batches.

Every batch is padded to a (rows, length) bucket: lengths are powers of two from 8 up to
``max_len`` (and ``max_len`` itself), rows powers of two up to ``max_rows``, and only the
pairs whose rows x length fits ``max_tokens`` (``(1, max_len)`` always does). Warm-up
compiles every pair, so serving never compiles. Inputs are sorted longest first and cut into
batches that fill a bucket, as sentence-transformers sorts its inputs, so the padding stays
small.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.bert import EncoderConfig, classify, encode
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.layers import dense_causal_attention
from jaxpaged.models.pooling import PoolingConfig, pool
from jaxpaged.worker.compile_counter import CompileCounter

MIN_LENGTH_BUCKET = 8


def _powers_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    sizes, s = [], start
    while s < limit:
        sizes.append(s)
        s *= 2
    return (*sizes, limit)


@dataclasses.dataclass(frozen=True)
class PoolingBuckets:
    """The (rows, length) shapes one engine compiles."""

    lengths: tuple[int, ...]
    rows: tuple[int, ...]
    max_tokens: int

    @classmethod
    def for_limits(cls, max_len: int, max_rows: int, max_tokens: int) -> PoolingBuckets:
        for name, v in (("max_model_len", max_len), ("max_num_seqs", max_rows)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        return cls(
            lengths=_powers_up_to(max_len, min(MIN_LENGTH_BUCKET, max_len)),
            rows=_powers_up_to(max_rows),
            max_tokens=max(max_tokens, max_len),
        )

    def length_for(self, n: int) -> int:
        return next(s for s in self.lengths if s >= n)

    def rows_for(self, length: int) -> tuple[int, ...]:
        """The row buckets of one length that fit the token budget (never empty)."""
        return tuple(r for r in self.rows if r * length <= self.max_tokens) or (1,)

    def shapes(self) -> list[tuple[int, int]]:
        return [(r, s) for s in self.lengths for r in self.rows_for(s)]


def plan_batches(
    lengths: Sequence[int], buckets: PoolingBuckets
) -> list[tuple[list[int], int, int]]:
    """(indices, rows, length) of each padded batch: the inputs sorted longest first, those
    of one length bucket batched together (so a long input does not pad the short ones to
    its length), in row buckets of the token budget; a remainder takes the next row bucket
    up when that pads at most a quarter of its rows, else the next one down (and the rest
    follows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plan: list[tuple[list[int], int, int]] = []
    i = 0
    while i < len(order):
        length = buckets.length_for(max(1, lengths[order[i]]))
        group = i
        while group < len(order) and buckets.length_for(max(1, lengths[order[group]])) == length:
            group += 1
        fits = buckets.rows_for(length)
        while i < group:
            rest = group - i
            up = next((r for r in fits if r >= rest), None)
            if up is not None and up - rest <= rest // 4:
                rows, take = up, rest
            else:
                rows = max(r for r in fits if r <= rest)
                take = rows
            plan.append((order[i : i + take], rows, length))
            i += take
    return plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolingModelInfo:
    """What the pooling runner needs to know of a model beyond its ModelConfig: an
    encoder's head and Matryoshka sizes (models/bert.py); a decoder has neither."""

    classifier: bool = False
    num_labels: int = 0
    id2label: tuple[str, ...] = ()
    score_activation: str = "sigmoid"
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    pad_token_id: int = 0

    @classmethod
    def of(cls, config: ModelConfig) -> PoolingModelInfo:
        if not isinstance(config, EncoderConfig):
            return cls()
        return cls(
            classifier=config.classifier,
            num_labels=config.num_labels,
            id2label=config.id2label,
            score_activation=config.score_activation,
            is_matryoshka=config.is_matryoshka,
            matryoshka_dimensions=config.matryoshka_dimensions,
            pad_token_id=config.pad_token_id,
        )


HiddenFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]


def hidden_states_fn(config: ModelConfig, graphdef: Any = None) -> HiddenFn:  # noqa: ANN401
    """``fn(params, tokens [B, S], mask [B, S], types [B, S]) -> hidden [B, S, D]``: an
    encoder's bidirectional forward, or a decoder's (``graphdef``: its NNX graph) dense
    causal forward of each row, whose right padding the real tokens never see."""
    if isinstance(config, EncoderConfig):
        return lambda params, tokens, mask, types: encode(params, config, tokens, mask, types)

    def decoder(params: Any, tokens: jax.Array, mask: jax.Array, types: jax.Array) -> jax.Array:  # noqa: ANN401
        del mask, types
        model = nnx.merge(graphdef, params)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        return jax.vmap(lambda row: model(row, positions, dense_causal_attention, None)[0])(tokens)

    return decoder


class PoolingRunner:
    """Runs an encoder over batches of token sequences: each input's pooled embedding
    (an embedding model) or its classifier logits (a cross-encoder), float32."""

    def __init__(
        self,
        config: ModelConfig,
        params: Any,  # noqa: ANN401 - the family's params tree, on the device
        pooling: PoolingConfig,
        buckets: PoolingBuckets,
        hidden_fn: HiddenFn,
        *,
        score_head: jax.Array | None = None,  # [C, D]: a decoder classifier's (models/seq_cls.py)
        info: PoolingModelInfo | None = None,  # None: what ``config`` says
    ) -> None:
        self.config, self.params, self.pooling, self.buckets = config, params, pooling, buckets
        self.info = PoolingModelInfo.of(config) if info is None else info
        self.score_head = score_head
        self._hidden_fn = hidden_fn
        self.counter = CompileCounter().open()
        self.warmup_compilations: int | None = None
        self.warmup_seconds = 0.0
        self._forward = jax.jit(self._make_forward())

    def _make_forward(self) -> Callable[..., jax.Array]:
        info, mode, hidden_fn = self.info, self.pooling.mode, self._hidden_fn

        def forward(
            params: Any,  # noqa: ANN401
            head: jax.Array | None,  # [C, D] a decoder classifier's score head
            tokens: jax.Array,  # int32 [B, S]
            mask: jax.Array,  # bool [B, S]
            types: jax.Array,  # int32 [B, S]
        ) -> jax.Array:  # float32 [B, D] pooled, or [B, C] logits
            hidden = hidden_fn(params, tokens, mask, types)
            if head is not None:  # the last token's hidden state through the score head
                return pool(hidden, mask, "last") @ head.T.astype(jnp.float32)
            if info.classifier:
                return classify(params, hidden)
            return pool(hidden, mask, mode)

        return forward

    @property
    def output_size(self) -> int:
        return self.info.num_labels if self.info.classifier else self.config.hidden_size

    def warm_up(self) -> int:
        """Compiles every bucket; returns how many programs that took."""
        start, before = time.perf_counter(), self.counter.count
        for rows, length in self.buckets.shapes():
            zeros = np.zeros((rows, length), np.int32)
            mask = np.zeros((rows, length), bool)
            jax.block_until_ready(self._forward(self.params, self.score_head, zeros, mask, zeros))
        self.warmup_compilations = self.counter.count - before
        self.warmup_seconds = time.perf_counter() - start
        return self.warmup_compilations

    @property
    def num_compilations(self) -> int:
        return self.counter.count

    @property
    def compilations_after_warmup(self) -> int:
        if self.warmup_compilations is None:
            return 0
        return self.counter.count - self.warmup_compilations

    def run(
        self,
        sequences: Sequence[Sequence[int]],  # each within the longest length bucket
        token_types: Sequence[Sequence[int] | None] | None = None,  # None: all segment 0
    ) -> np.ndarray:  # float32 [N, output_size], in the order given
        """Every sequence's output, in the batches of `plan_batches`."""
        out = np.empty((len(sequences), self.output_size), np.float32)
        pending: list[tuple[list[int], Any]] = []
        for chosen, rows, length in plan_batches([len(s) for s in sequences], self.buckets):
            tokens = np.full((rows, length), self.info.pad_token_id, np.int32)
            types = np.zeros((rows, length), np.int32)
            mask = np.zeros((rows, length), bool)
            for row, j in enumerate(chosen):
                seq = sequences[j]
                tokens[row, : len(seq)] = seq
                mask[row, : len(seq)] = True
                if token_types is not None and token_types[j] is not None:
                    types[row, : len(seq)] = token_types[j]
            # dispatched without waiting: the next batch is padded while this one runs
            pending.append(
                (chosen, self._forward(self.params, self.score_head, tokens, mask, types))
            )
        for chosen, result in pending:
            out[chosen] = np.asarray(result)[: len(chosen)]
        return out

    def close(self) -> None:
        self.counter.close()
        self.params = self.score_head = None
