"""EAGLE-3 drafting inside the engine step (``speculative_config={"method": "eagle3"}``).

The head (models/eagle3.py) keeps its K/V as one more layer of the target's pool (layer L,
after the target's L layers): the same blocks, block tables, copy-on-write, swaps and
prefix cache serve it, and its attention is the step's own paged attention. A head's
input at position p is the token at p + 1 and a hidden state at p, so one step does both
ends of the work:

* **before the target's forward** (steps that verify drafts): drafts 2..K of each drafting
  sequence, one head pass each (one query row per sequence). Pass j feeds draft j - 1 and
  the previous pass's pre-norm output at the sequence's position ``start + j - 2`` (its K/V
  written at that row's slot, which this step's plan allotted). Draft 1 and the hidden state
  it came from were left by the sequence's previous step (:class:`EagleState`, by the
  request's row of the persistent batch). The drafts replace the placeholder tokens of the
  sequence's draft rows: nothing waits for the host.
* **after verification**: the head over every fed row, fed the token after the row (the
  next fed token; at the row of the last accepted token, the target's own next token) and
  ``fc`` over the target's three aux hidden states of the row. That writes the head's K/V at
  every fed position (overwriting what the passes wrote there) and, at the last accepted
  row, gives draft 1 of the next step and its hidden state: the sequence's new
  :class:`EagleState` row.

Rows past the last accepted one hold stale head K/V until the next step rewrites them from
its first position, before any query reads them. Drafts never change what is emitted (the
target verifies every draft); a head's K/V that another continuation wrote (a cached
block's last position, a swapped-in request's state row) only lowers acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpaged.models import eagle3
from jaxpaged.models.eagle3 import Eagle3Config

__all__ = ["EagleState", "catch_up", "create_state", "propose"]

# (slot_mapping [N], kv_lens [S], cu_q_lens [S + 1], max_q_len) -> an AttentionFn over the
# step's pool with the step's block tables
AttentionFor = Callable[[jax.Array, jax.Array, jax.Array, int | None], Any]


class EagleState(NamedTuple):
    """Per row of the persistent batch (R + 1 rows: the last one is padding's): what the
    request's previous step left for its next drafts."""

    tokens: jax.Array  # int32 [R + 1] draft 1 (a target id)
    hidden: jax.Array  # [R + 1, H] the head's pre-norm output it came from


def create_state(num_rows: int, hidden_size: int, dtype: Any) -> EagleState:  # noqa: ANN401
    return EagleState(
        jnp.zeros((num_rows + 1,), jnp.int32), jnp.zeros((num_rows + 1, hidden_size), dtype)
    )


def propose(
    head: dict[str, jax.Array],
    config: Eagle3Config,
    state: EagleState,
    target_embed: jax.Array,  # [V, H] the target's embedding table
    pool: Any,  # noqa: ANN401
    *,
    seq_rows: jax.Array,  # int32 [S] each sequence's row of the persistent batch
    cu_q_lens: jax.Array,  # int32 [S + 1]
    positions: jax.Array,  # int32 [T]
    slot_mapping: jax.Array,  # int32 [T]
    num_drafts: jax.Array,  # int32 [S]
    num_speculative_tokens: int,
    layer_index: int,
    attention_for: AttentionFor,
) -> tuple[jax.Array, Any]:  # drafts int32 [S, K], pool
    """Drafts 1..K of every sequence (see the module docstring); the head's K/V of passes
    2..K written at the drafting sequences' rows."""
    s = seq_rows.shape[0]
    first = jnp.minimum(cu_q_lens[:-1], positions.shape[0] - 1)  # [S]
    start = positions[first]
    token, hidden = state.tokens[seq_rows], state.hidden[seq_rows]
    drafts = [token]
    one_row = jnp.arange(s + 1, dtype=jnp.int32)
    for j in range(2, num_speculative_tokens + 1):
        live = num_drafts >= j
        pos = jnp.where(live, start + j - 2, 0)  # [S]
        slots = jnp.where(live, slot_mapping[first + j - 2], -1)
        # a sequence without draft j reads position 0 only: never past its blocks
        attention_fn = attention_for(slots, jnp.where(live, pos + 1, 1), one_row, 1)
        embeds = eagle3.embed(head, target_embed, token, hidden.dtype)
        normed, hidden, pool = eagle3.head_forward(
            head, config, embeds, hidden, pos, attention_fn, pool, layer_index=layer_index
        )
        token = eagle3.draft_ids(head, normed)
        drafts.append(token)
    return jnp.stack(drafts, axis=1), pool


def catch_up(
    head: dict[str, jax.Array],
    config: Eagle3Config,
    state: EagleState,
    target_embed: jax.Array,  # [V, H]
    pool: Any,  # noqa: ANN401
    *,
    aux: jax.Array,  # [T, 3 * H_target] the target's aux hidden states of every fed row
    tokens: jax.Array,  # int32 [T] the fed tokens (drafts included)
    positions: jax.Array,  # int32 [T]
    seq_rows: jax.Array,  # int32 [S]
    last_rows: jax.Array,  # int32 [S] each sequence's last accepted row
    next_tokens: jax.Array,  # int32 [S] the token after it (the target's sample)
    num_seqs: jax.Array,  # int32 [] sequences in the step (the rest are padding)
    layer_index: int,
    attention_fn: Any,  # noqa: ANN401 - the step's AttentionFn over its own batch
) -> tuple[EagleState, Any]:
    """The head over every fed row, and each sequence's next draft 1 and hidden state."""
    t = tokens.shape[0]
    following = jnp.concatenate([tokens[1:], tokens[-1:]])  # [T] the next row's token
    real = jnp.arange(last_rows.shape[0]) < num_seqs
    following = following.at[jnp.where(real, last_rows, t)].set(next_tokens, mode="drop")
    hidden = eagle3.combine_aux(head, aux)
    embeds = eagle3.embed(head, target_embed, following, hidden.dtype)
    normed, prenorm, pool = eagle3.head_forward(
        head, config, embeds, hidden, positions, attention_fn, pool, layer_index=layer_index
    )
    first = eagle3.draft_ids(head, normed[last_rows])  # [S]
    state = EagleState(
        state.tokens.at[seq_rows].set(first),
        state.hidden.at[seq_rows].set(prenorm[last_rows].astype(state.hidden.dtype)),
    )
    return state, pool
