"""Pure-jnp ragged paged attention: the readable definition of the kernels' semantics.

Every query token gathers its own sequence's whole KV history and runs plain softmax
attention in float32. That is O(num_tokens * max_context) memory: fine for tests and
for defining what the fast backends must match, never for serving.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Large negative logit for masked positions; finite so that fully masked rows (padding)
# stay NaN-free.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def token_metadata(
    cu_q_lens: jax.Array,  # int32 [S + 1]
    kv_lens: jax.Array,  # int32 [S]
    num_seqs: jax.Array,  # int32 scalar
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: (sequence index, absolute position, row is real).

    Row t belongs to the sequence s with cu_q_lens[s] <= t < cu_q_lens[s + 1]; its
    position is kv_lens[s] - q_len_s + (t - cu_q_lens[s]). Rows at or past
    cu_q_lens[num_seqs] are padding.
    """
    rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    num_real = cu_q_lens[num_seqs]
    # Entries past num_seqs may hold anything: replace them so the ends stay sorted.
    ends = jnp.where(
        jnp.arange(kv_lens.shape[0]) < num_seqs, cu_q_lens[1:], jnp.iinfo(jnp.int32).max
    )  # [S]
    # Number of sequence ends at or before t = index of the sequence holding t.
    seq = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # [T]
    seq = jnp.minimum(seq, kv_lens.shape[0] - 1)
    valid = rows < num_real  # [T]
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    pos = kv_lens[seq] - q_len + (rows - q_start)  # [T]
    return seq, pos, valid


def clamp_limits(
    limits: jax.Array,  # int32 [T] the last key position each row may see
    pos: jax.Array,  # int32 [T] each row's position
    kv_len: jax.Array,  # int32 [T] its sequence's length
) -> jax.Array:  # int32 [T]
    """The last key position each row sees given ``causal_limits``: at least its own
    position (a limit never hides what causal attention shows), at most its sequence's
    last cached position (a row never reads past what is written)."""
    return jnp.maximum(jnp.minimum(limits, kv_len - 1), pos)


def alibi_bias(
    slopes: jax.Array,  # float32, broadcastable against the other two: one per query head
    kv_pos: jax.Array,  # int32 key positions
    q_pos: jax.Array,  # int32 query positions
) -> jax.Array:  # float32, the broadcast shape
    """ALiBi's logit bias ``slope * (key_pos - query_pos)`` (<= 0 on every visible key).
    transformers' BLOOM adds ``slope * key_pos``; the two differ by a constant per query row,
    which softmax cancels, and this form stays small for long contexts."""
    return slopes * (kv_pos - q_pos).astype(jnp.float32)


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [N, B, Hkv, D]
    v_pages: jax.Array,  # [N, B, Hkv, D]
    kv_lens: jax.Array,  # int32 [S]
    block_tables: jax.Array,  # int32 [S, P]
    cu_q_lens: jax.Array,  # int32 [S + 1]
    num_seqs: jax.Array,  # int32 scalar or [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # float32 [N, B, Hkv]: with an 8-bit pool (kv_quant.py)
    v_scales: jax.Array | None = None,  # float32 [N, B, Hkv]
    alibi_slopes: jax.Array | None = None,  # float32 [Hq]: ALiBi (BLOOM)
    causal_limits: jax.Array | None = None,  # int32 [T]: the last key position each row sees
) -> jax.Array:  # [T, Hq, D]
    """Causal GQA attention of each query row over its sequence's paged KV (an 8-bit
    pool's rows are dequantized with their scales first). With ``alibi_slopes``, head h's
    logit of key position j for a query at position i gains ``slopes[h] * (j - i)`` after
    scaling and soft cap (``alibi_bias``). With ``causal_limits`` a row sees keys up to
    ``clamp_limits`` of it instead of up to its own position (the sliding window's lower
    bound stays relative to the row's position)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    num_seqs = jnp.reshape(num_seqs, (-1,))[0]

    seq, pos, valid = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    # Each row's sequence's KV, block by block: [T, P * B, Hkv, D].
    tables = block_tables[seq]  # [T, P]
    k = k_pages[tables].reshape(num_tokens, -1, num_kv_heads, head_dim)
    v = v_pages[tables].reshape(num_tokens, -1, num_kv_heads, head_dim)
    k = k.astype(jnp.float32)
    v = v.astype(jnp.float32)
    if k_scales is not None:
        k = k * k_scales[tables].reshape(num_tokens, -1, num_kv_heads)[..., None]
        v = v * v_scales[tables].reshape(num_tokens, -1, num_kv_heads)[..., None]

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    logits = jnp.einsum("thgd,tkhd->thgk", qg, k) * sm_scale  # [T, Hkv, G, K]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)  # [K]
    if alibi_slopes is not None:
        slopes = alibi_slopes.reshape(num_kv_heads, group)[None, :, :, None]
        logits = logits + alibi_bias(slopes, kv_pos[None, None, None, :], pos[:, None, None, None])
    last = pos if causal_limits is None else clamp_limits(causal_limits, pos, kv_lens[seq])
    allowed = kv_pos[None, :] <= last[:, None]  # [T, K]
    if sliding_window is not None:
        allowed &= kv_pos[None, :] > pos[:, None] - sliding_window
    allowed &= valid[:, None]
    logits = jnp.where(allowed[:, None, None, :], logits, MASK_VALUE)

    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("thgk,tkhd->thgd", probs, v).reshape(num_tokens, num_q_heads, head_dim)
    out = jnp.where(valid[:, None, None], out, 0.0)
    return out.astype(q.dtype)
