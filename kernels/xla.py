"""Ragged paged attention from XLA ops (gathers, einsums, loops): the default on CPU.

Query rows are split in two kinds, each handled where it is cheap:

* the **last row of every sequence** (all of a decode step; one row of each prefill
  chunk) is handled batched over sequences: each sequence's KV blocks are gathered once
  and all of its query heads (GQA group) read them in one einsum;
* the **other rows** (the body of prefill chunks) are cut into tiles of `q_tile` rows of
  one sequence; a loop runs over the tiles that exist this call, so work follows the
  real prefill tokens and never multiplies one long prompt by the number of sequences.

Both stream the KV in chunks of `kv_chunk` tokens with an online softmax (flash style),
stopping at the last chunk any row can see, so memory stays bounded for long contexts
and causal/sliding-window blocks that no row can see are never read. Only the blocks
named in `block_tables` are gathered: the pool itself is never copied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .kv_quant import dequantize
from .reference import MASK_VALUE, alibi_bias, clamp_limits

DEFAULT_Q_TILE = 64
DEFAULT_KV_CHUNK = 128


def _cdiv(a, b):
    return (a + b - 1) // b


def _attend(
    q: jax.Array,  # [N, R, Hkv, G, D]   N groups of R rows; each group reads one sequence
    pos: jax.Array,  # int32 [N, R]  absolute position of each row
    last: jax.Array,  # int32 [N, R]  the last key position each row sees (>= pos)
    row_valid: jax.Array,  # bool [N, R]
    tables: jax.Array,  # int32 [N, P]  block table of each group's sequence
    first_block: jax.Array,  # int32 [N]  first block any row of the group may see
    num_chunks: jax.Array,  # int32 scalar  chunks to visit (max over groups)
    k_pages: jax.Array,  # [NB, B, Hkv, D]
    v_pages: jax.Array,  # [NB, B, Hkv, D]
    scales: tuple[jax.Array, jax.Array] | None,  # float32 [NB, B, Hkv] each, 8-bit pools
    *,
    blocks_per_chunk: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    slopes: jax.Array | None = None,  # float32 [Hkv, G]: ALiBi slopes of the query heads
) -> jax.Array:  # [N, R, Hkv, G, D] float32
    """Online-softmax attention of each group's rows over its sequence, chunk by chunk."""
    n, r, hkv, g, d = q.shape
    block_size = k_pages.shape[1]
    max_blocks = tables.shape[1]
    chunk = blocks_per_chunk * block_size
    # an 8-bit pool is dequantized to the query's dtype as each chunk is gathered
    compute_dtype = k_pages.dtype if scales is None else q.dtype
    # Rows and the query heads of one KV head form the M dimension of one matmul.
    qc = q.astype(compute_dtype).transpose(0, 2, 3, 1, 4).reshape(n, hkv, g * r, d)

    def body(c, carry):
        m, denom, acc = carry
        blk = first_block[:, None] + c * blocks_per_chunk + jnp.arange(blocks_per_chunk)  # [N, C]
        ids = jnp.take_along_axis(tables, jnp.minimum(blk, max_blocks - 1), axis=1)  # [N, C]
        # XLA:CPU runs batched dots fastest with batch dims leading and no transposed
        # operand: K as [N, Hkv, D, L], V as [N, Hkv, L, D].
        k = k_pages[ids].reshape(n, chunk, hkv, d)
        v = v_pages[ids].reshape(n, chunk, hkv, d)
        if scales is not None:
            k = dequantize(k, scales[0][ids].reshape(n, chunk, hkv), compute_dtype)
            v = dequantize(v, scales[1][ids].reshape(n, chunk, hkv), compute_dtype)
        k = k.transpose(0, 2, 3, 1)
        v = v.transpose(0, 2, 1, 3)
        s = jnp.einsum("nhmd,nhdl->nhml", qc, k, preferred_element_type=jnp.float32)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = (blk[:, :, None] * block_size + jnp.arange(block_size)).reshape(n, chunk)
        if slopes is not None:
            bias = alibi_bias(
                slopes[None, :, :, None, None],
                kv_pos[:, None, None, None, :],
                pos[:, None, None, :, None],
            )  # [N, Hkv, G, R, L]
            s = s + bias.reshape(n, hkv, g * r, chunk)
        ok = kv_pos[:, None, :] <= last[:, :, None]  # [N, R, L]
        if sliding_window is not None:
            ok &= kv_pos[:, None, :] > pos[:, :, None] - sliding_window
        ok &= row_valid[:, :, None] & (blk < max_blocks).repeat(block_size, axis=1)[:, None, :]
        ok = jnp.broadcast_to(ok[:, None, None], (n, 1, g, r, chunk)).reshape(n, 1, g * r, chunk)
        s = jnp.where(ok, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))  # [N, Hkv, M]
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = alpha * denom + p.sum(axis=-1)
        pv = jnp.einsum(
            "nhml,nhld->nhmd", p.astype(compute_dtype), v, preferred_element_type=jnp.float32
        )
        acc = alpha[..., None] * acc + pv
        return m_new, denom, acc

    init = (
        jnp.full((n, hkv, g * r), MASK_VALUE, jnp.float32),
        jnp.zeros((n, hkv, g * r), jnp.float32),
        jnp.zeros((n, hkv, g * r, d), jnp.float32),
    )
    if isinstance(num_chunks, int) and num_chunks == 1:
        _, denom, acc = body(0, init)
    else:
        _, denom, acc = lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [N, Hkv, G * R, D]
    return out.reshape(n, hkv, g, r, d).transpose(0, 3, 1, 2, 4)


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [NB, B, Hkv, D]
    v_pages: jax.Array,  # [NB, B, Hkv, D]
    kv_lens: jax.Array,  # int32 [S]
    block_tables: jax.Array,  # int32 [S, P]
    cu_q_lens: jax.Array,  # int32 [S + 1]
    num_seqs: jax.Array,  # int32 scalar or [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    q_tile: int = DEFAULT_Q_TILE,
    kv_chunk: int = DEFAULT_KV_CHUNK,
    k_scales: jax.Array | None = None,  # float32 [NB, B, Hkv]: with an 8-bit pool (kv_quant.py)
    v_scales: jax.Array | None = None,  # float32 [NB, B, Hkv]
    alibi_slopes: jax.Array | None = None,  # float32 [Hq]: ALiBi (reference.alibi_bias)
    causal_limits: jax.Array | None = None,  # int32 [T]: the last key position each row sees
) -> jax.Array:  # [T, Hq, D]
    """See `jaxpaged.kernels.ragged_paged_attention`; extra static hints:

    max_q_len: upper bound on any sequence's query length this call (1 = decode only:
      the prefill-tile loop is not even compiled).
    max_kv_len: upper bound on kv_lens; lets a call whose contexts fit in one
      `kv_chunk` compile without a loop.
    q_tile / kv_chunk: tile sizes (rows of one sequence; KV tokens per step).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    max_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    num_seqs = jnp.reshape(num_seqs, (-1,))[0]
    blocks_per_chunk = max(1, min(max_blocks, kv_chunk // block_size))
    if max_kv_len is not None:
        blocks_per_chunk = max(1, min(blocks_per_chunk, _cdiv(max_kv_len, block_size)))
    chunk = blocks_per_chunk * block_size
    static_chunks = None
    if max_kv_len is not None and max_kv_len <= chunk:
        static_chunks = 1
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)

    seq_ids = jnp.arange(max_seqs, dtype=jnp.int32)
    seq_valid = seq_ids < num_seqs  # [S]
    q_start = cu_q_lens[:-1]
    q_len = jnp.where(seq_valid, cu_q_lens[1:] - q_start, 0)  # [S]
    kv_lens = jnp.where(seq_valid, kv_lens, 0)

    def first_block_of(p):  # first block a row at position p can see
        if sliding_window is None:
            return jnp.zeros_like(p)
        return jnp.maximum(p - sliding_window + 1, 0) // block_size

    def chunks_for(first, last_pos, valid):  # chunks to reach last_pos from block first
        need = _cdiv(last_pos // block_size + 1 - first, blocks_per_chunk)
        return jnp.max(jnp.where(valid, need, 0))

    # --- last row of every sequence, batched over sequences -------------------------
    has_q = q_len > 0
    last_row = jnp.clip(q_start + q_len - 1, 0, num_tokens - 1)  # [S]
    last_pos = kv_lens - 1
    first = first_block_of(last_pos)
    n_chunks = static_chunks or chunks_for(first, last_pos, has_q)

    def attend(q_rows, pos, last, valid, tables, first, n_chunks):  # _attend on this pool
        return _attend(
            q_rows, pos, last, valid, tables, first, n_chunks, k_pages, v_pages,
            None if k_scales is None else (k_scales, v_scales),
            blocks_per_chunk=blocks_per_chunk, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap,
            slopes=None if alibi_slopes is None else alibi_slopes.reshape(num_kv_heads, group),
        )  # fmt: skip

    # a sequence's last row sits at its last cached position: no limit lets it see further
    out_last = attend(
        qg[last_row][:, None],
        last_pos[:, None],
        last_pos[:, None],
        has_q[:, None],
        block_tables,
        first,
        n_chunks,
    )[:, 0]  # [S, Hkv, G, D]
    dest = jnp.where(has_q, last_row, num_tokens)
    out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
    out = out.at[dest].set(out_last, mode="drop", unique_indices=True)

    # --- the other rows, in tiles of q_tile rows of one sequence --------------------
    if max_q_len is None or max_q_len > 1:
        bound = num_tokens if max_q_len is None else min(num_tokens, max_q_len)
        tile = max(1, min(q_tile, bound - 1))
        body_len = jnp.maximum(q_len - 1, 0)  # rows before the last one
        tiles_per_seq = _cdiv(body_len, tile)  # [S]
        tile_end = jnp.cumsum(tiles_per_seq)  # [S]
        num_tiles = min(num_tokens - 1, _cdiv(num_tokens, tile) + max_seqs)
        if max_q_len is not None:
            num_tiles = min(num_tiles, max_seqs * _cdiv(max_q_len - 1, tile))

        def one_tile(i, out):
            s = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), max_seqs - 1)
            j = i - (tile_end[s] - tiles_per_seq[s])
            offs = j * tile + jnp.arange(tile, dtype=jnp.int32)  # [R] offsets in the chunk
            ok = offs < body_len[s]
            rows = jnp.clip(q_start[s] + offs, 0, num_tokens - 1)
            pos = kv_lens[s] - q_len[s] + offs
            last = pos
            if causal_limits is not None:
                last = clamp_limits(causal_limits[rows], pos, kv_lens[s])
            f = first_block_of(pos[0])
            nc = static_chunks or chunks_for(f[None], jnp.max(jnp.where(ok, last, 0))[None], ok[:1])
            res = attend(
                qg[rows][None], pos[None], last[None], ok[None], block_tables[s][None], f[None], nc
            )[0]
            dest = jnp.where(ok, rows, num_tokens)
            return out.at[dest].set(res, mode="drop", unique_indices=True)

        if num_tiles > 0:
            # A loop over the tiles that exist this call: empty ones cost nothing.
            out = lax.fori_loop(0, jnp.minimum(tile_end[-1], num_tiles), one_tile, out)

    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
