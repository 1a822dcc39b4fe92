"""How far a quantized model is from its float original: greedy agreement and perplexity,
both from whole-sequence forwards (no engine), so they measure the weights alone.

Greedy agreement is teacher-forced: the quantized model reads the float model's greedy
continuation and the first position where its own argmax differs is where a free-running
quantized decode would first part from the float one (up to there the two sequences are
the same tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..llama import compute_logits, forward
from ..types import LinearFn

__all__ = ["first_divergence", "perplexity", "perplexity_of", "sequence_logits"]


def sequence_logits(
    params: Any, config: ModelConfig, tokens: Sequence[int], linear_fn: LinearFn | None = None
) -> np.ndarray:  # float32 [T, V]
    """The logits at every position of ``tokens``, one forward over the whole sequence."""
    # padded to a multiple of 64 at the end (causal: the real positions' logits are
    # unchanged), so texts of similar length share one compiled program
    padded = -(-len(tokens) // 64) * 64
    ids = jnp.asarray([*tokens, *[0] * (padded - len(tokens))], jnp.int32)

    @jax.jit
    def run(p, ids):
        hidden, _ = forward(p, ids, jnp.arange(ids.shape[0]), config=config, linear_fn=linear_fn)
        return compute_logits(p, hidden, config=config, linear_fn=linear_fn)

    return np.asarray(run(params, ids))[: len(tokens)]


def perplexity(
    params: Any,
    config: ModelConfig,
    tokens: Sequence[int],  # the text's token ids
    *,
    linear_fn: LinearFn | None = None,
) -> float:
    """exp of the mean negative log-likelihood of tokens[1:] given their prefixes."""
    return perplexity_of(sequence_logits(params, config, tokens, linear_fn), tokens)


def perplexity_of(
    logits: np.ndarray,  # float32 [T, V]: `sequence_logits` of tokens
    tokens: Sequence[int],
) -> float:
    """`perplexity` from logits already computed."""
    logits = logits[:-1].astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - logits[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
    return float(np.exp(nll.mean()))


def first_divergence(
    params: Any,
    config: ModelConfig,
    prompt: Sequence[int],
    continuation: Sequence[int],  # the reference model's greedy tokens after ``prompt``
    *,
    linear_fn: LinearFn | None = None,
) -> int | None:
    """The first index of ``continuation`` this model would not have chosen greedily, or
    None when it agrees on all of them."""
    tokens = [*prompt, *continuation]
    logits = sequence_logits(params, config, tokens, linear_fn)[len(prompt) - 1 : -1]
    mismatch = np.flatnonzero(logits.argmax(-1) != np.asarray(continuation))
    return int(mismatch[0]) if mismatch.size else None
