"""Verification of drafted tokens inside the step (speculative decoding).

A sequence that verifies ``d`` drafts feeds ``d + 1`` tokens: its last known token, then the
drafts. The step samples the target model after each of them (``K + 1`` rows per sequence,
``K`` = num_speculative_tokens, fixed per engine: one compiled shape) with the random stream
a step without speculation would use for that output position (``key_counter + j``), and
keeps the longest run of drafts that equal the target's own samples, plus the target's token
after that run.

Why that is exact. The drafts are a point mass q = delta(x) (n-gram lookup proposes, draft
models and EAGLE-3 heads draft greedily: none samples). Rejection sampling accepts x with probability min(1, p(x) / q(x)) = p(x)
and on rejection draws from the residual norm(max(p - q, 0)) = p without x, renormalised.
Drawing y ~ p and accepting iff y == x does exactly that: P(accept) = p(x), and a rejected
y is distributed as p conditioned on y != x. With greedy sampling y is the argmax, so the
output is token-identical to decoding without drafts; with a seed it is identical too,
since position j draws from the stream of output index ``key_counter + j`` as it would
unspeculated. Logprobs are the target's at each emitted position.

Per-request state that follows the token history (penalties, min_tokens, logit_bias,
logits processors) is read only at position 0: such requests do not draft
(``Request.can_speculate``), and their later rows are ignored. Grammar masks come per
position (a copy of the request's matcher walks its drafts on the host: n-gram drafts
when planned, device drafts once read back, jaxpaged.worker.spec_grammar): a draft the grammar rejects is never sampled there, so verification stops at it,
and every emitted token obeys the mask of its own position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.worker.sampler import SamplingTensors

__all__ = ["expand_sampling", "num_emitted", "verify_rows"]


def expand_sampling(t: SamplingTensors, k1: int) -> SamplingTensors:  # [S, ...] -> [S*k1, ...]
    """Each sequence's sampling settings for its ``k1`` verification rows (row ``i * k1 +
    j`` = position j of sequence i): the stream counter advances by j; the state row stays
    at position 0 (see the module docstring). The grammar masks come per row already
    (``allowed`` [S * k1, W]: each position's, after the drafts before it)."""
    s = t.temperature.shape[0]
    if t.allowed.shape[0] != s * k1:
        raise ValueError(f"allowed has {t.allowed.shape[0]} rows, want {s} x {k1}")
    rep = [jnp.repeat(x, k1, axis=0) for x in t[:-1]]
    out = SamplingTensors(*rep, allowed=t.allowed)
    j = jnp.tile(jnp.arange(k1, dtype=jnp.uint32), s)  # [S*k1]
    return out._replace(
        key_counter=out.key_counter + j,
        state_rows=jnp.where(j == 0, out.state_rows, -1),
    )


def num_emitted(
    drafts: jax.Array,  # int32 [S, K] drafted tokens (fed after each sequence's last token)
    targets: jax.Array,  # int32 [S, K + 1] the target's sample after each fed token
    num_drafts: jax.Array,  # int32 [S] drafts each sequence verifies (0: none)
) -> jax.Array:  # int32 [S] in 1 .. num_drafts + 1
    """Tokens each sequence emits: its accepted drafts (the longest prefix equal to the
    target's samples) and the target's token after them."""
    k = drafts.shape[1]
    valid = jnp.arange(k)[None, :] < num_drafts[:, None]
    match = (drafts == targets[:, :k]) & valid
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return (accepted + 1).astype(jnp.int32)


def verify_rows(
    last_rows: np.ndarray,  # int [n] each sequence's last fed row
    drafts: np.ndarray,  # int [n] how many drafts it feeds (its last fed rows)
    num_seqs: int,
    k1: int,
) -> np.ndarray:  # int32 [num_seqs, k1]
    """Host side: the rows whose hidden states give each sequence's ``k1`` verification
    samples (its last ``drafts + 1`` fed rows, the last one repeated after them); padding
    sequences read row 0."""
    n = len(last_rows)
    last = np.asarray(last_rows, np.int64)[:, None]
    d = np.asarray(drafts, np.int64)[:, None]
    out = np.zeros((num_seqs, k1), np.int32)
    out[:n] = last - d + np.minimum(np.arange(k1)[None, :], d)
    return out
