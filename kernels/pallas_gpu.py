"""Ragged paged attention as Pallas kernels for NVIDIA GPUs (Triton lowering).

One op, two launches, split the same way as the XLA path:

* **decode kernel**: the last query row of every sequence (a whole decode step), grid
  (sequence, KV head, KV split). Each program takes the GQA group of query heads that
  share one KV head as the rows of one matmul (padded to 16), streams its share of the
  sequence's KV blocks through the block table with an online softmax, and writes
  unnormalised partial results; splits are merged in XLA (flash-decoding), so long
  contexts at small batch still fill the GPU.
* **prefill kernel**: the other query rows, in tiles of `TQ` tokens of one sequence
  (x the padded GQA group = one matmul of `TQ * Gp` rows), grid (tile, KV head). Each
  program streams KV from the first block its rows can see (sliding window) to the
  last one (causal), so the work follows the real tokens; tiles past the real count
  exit at once.

Query rows are gathered into tiles and the results scattered back in XLA, so the
kernels only do blocked loads/stores plus the block-table gathers of KV. Every tensor
the kernels touch has power-of-two sizes (a Triton requirement): head_dim, the matmul
rows (>= 16) and `pages_per_step * block_size` (>= 16).

The Triton lowering is selected explicitly (`plgpu.CompilerParams`), so the same code
runs on JAX 0.10 and 0.11 whichever GPU lowering is the default; `interpret=True` runs
it on any backend for tests.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .pallas_tiles import (  # noqa: F401  (PallasConfig, choose_config: public here too)
    SMEM_BUDGET,
    PallasConfig,
    _pages_per_step,
    _prefill_rows,
    choose_config,
    smem_bytes,
    unsupported_reason,
)
from .reference import MASK_VALUE, alibi_bias

_SQUEEZED = getattr(pl, "squeezed", None)
_LOG2E = math.log2(math.e)


def _cdiv(a, b):
    return (a + b - 1) // b


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _ignore_triton_deprecation() -> None:
    """JAX 0.11 deprecates the Pallas Triton backend and warns at every lowering, i.e. once per
    compiled program that holds these kernels. The kernels keep the Triton lowering on purpose
    (it runs on every NVIDIA GPU JAX supports; Mosaic GPU needs Hopper), so that one message
    is ignored, from the moment these kernels are traced. Idempotent: ``filterwarnings``
    replaces an identical filter instead of adding another."""
    warnings.filterwarnings("ignore", message=r"(?s).*Triton backend is deprecated")


def _stream_kv(
    q,  # [M, D] query rows (compute dtype)
    pos,  # int32 [M, 1] absolute position of each row
    row_ok,  # bool [M, 1]
    tables_ref,  # int32 ref [S, P_pad] block tables
    seq,  # int32: the sequence whose blocks are read
    k_ref,  # ref [NB, B, D] the pool for this KV head
    v_ref,  # ref [NB, B, D]
    first_page,  # int32: first block to read
    end_page,  # int32: one past the last block to read
    *,
    pages_per_step: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    scale_refs=None,  # (k, v) f32 refs [NB, B] for this KV head: an 8-bit pool's scales
    slopes=None,  # f32 [M, 1]: each row's ALiBi slope (its query head's)
    last=None,  # int32 [M, 1]: the last key position each row sees (default: pos)
):
    """Online-softmax attention of q over blocks [first_page, end_page) of one sequence.
    An 8-bit pool's tiles are dequantized to q's dtype right after they are loaded; with
    ``slopes``, ALiBi's ``slope * (key_pos - pos)`` is added to the logits.

    Returns (acc [M, D] f32, unnormalised; m [M] f32 running max; l [M] f32 sum).
    """
    m_rows, head_dim = q.shape
    block_size = k_ref.shape[1]
    block_k = pages_per_step * block_size
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(i, carry):
        acc, m_prev, l_prev = carry
        page0 = first_page + i * pages_per_step
        ids = tables_ref[seq, pl.ds(page0, pages_per_step)]  # [C]
        k = k_ref[ids].reshape(block_k, head_dim)
        v = v_ref[ids].reshape(block_k, head_dim)
        if scale_refs is not None:
            ks = scale_refs[0][ids].reshape(block_k, 1)
            vs = scale_refs[1][ids].reshape(block_k, 1)
            k = (k.astype(jnp.float32) * ks).astype(q.dtype)
            v = (v.astype(jnp.float32) * vs).astype(q.dtype)
        s = lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [M, BK]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = page0 * block_size + jnp.arange(block_k, dtype=jnp.int32)[None, :]  # [1, BK]
        if slopes is not None:
            s = s + alibi_bias(slopes, kv_pos, pos)
        ok = (kv_pos <= (pos if last is None else last)) & (kv_pos < end_page * block_size)
        ok &= row_ok
        if sliding_window is not None:
            ok &= kv_pos > pos - sliding_window
        s = jnp.where(ok, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(ok, jnp.exp2((s - m_next[:, None]) * _LOG2E), 0.0)
        alpha = jnp.exp2((m_prev - m_next) * _LOG2E)
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [M, D]
        return alpha[:, None] * acc + pv, m_next, l_next

    n_steps = jnp.maximum(_cdiv(end_page - first_page, pages_per_step), 0)
    init = (
        jnp.zeros((m_rows, head_dim), jnp.float32),
        jnp.full((m_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    return lax.fori_loop(0, n_steps, body, init)


def _first_page(pos, sliding_window, block_size):
    if sliding_window is None:
        return jnp.int32(0)
    return jnp.maximum(pos - sliding_window + 1, 0) // block_size


def _split_refs(refs, quantized: bool, alibi: bool):
    """(scale refs or None, slopes ref or None, the rest): the optional inputs after the pool."""
    scale_refs, refs = (refs[:2], refs[2:]) if quantized else (None, refs)
    slopes_ref, refs = (refs[0], refs[1:]) if alibi else (None, refs)
    return scale_refs, slopes_ref, refs


def _tile_limits(
    causal_limits: jax.Array,  # int32 [T] each row's last visible key (unclamped)
    src: jax.Array,  # int32 [NT, TQ] each tile row's query row
    pos: jax.Array,  # int32 [NT, TQ] its position
    kv_len: jax.Array,  # int32 [NT, 1] its sequence's length
    row_ok: jax.Array,  # bool [NT, TQ]
    group_pad: int,
) -> tuple[jax.Array, jax.Array]:  # int32 [NT, TQ * Gp], int32 [NT]
    """The prefill kernel's inputs for ``causal_limits``: each matmul row's last visible key
    (clamped as reference.clamp_limits; row m of a tile is query token m // Gp) and each
    tile's furthest one (where its blocks end)."""
    last = jnp.maximum(jnp.minimum(causal_limits[src], kv_len - 1), pos)
    furthest = jnp.max(jnp.where(row_ok, last, 0), axis=1)
    return jnp.repeat(last, group_pad, axis=1).astype(jnp.int32), furthest.astype(jnp.int32)


def _decode_kernel(
    split_pages_ref,  # int32 [1]  pages per split this call (from the real longest context)
    kv_lens_ref,  # int32 [S]
    tables_ref,  # int32 [S, P_pad]
    q_ref,  # [BH, D]
    k_ref,  # [NB, B, D]
    v_ref,  # [NB, B, D]
    *refs,  # [k_scales, v_scales (f32 [NB, B]) if quantized], [slopes f32 [BH] if alibi],
    # o [BH, D], m [BH], l [BH] f32
    pages_per_step: int,
    group: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized: bool = False,
    alibi: bool = False,
):
    scale_refs, slopes_ref, (o_ref, m_ref, l_ref) = _split_refs(refs, quantized, alibi)
    seq = pl.program_id(0)
    split = pl.program_id(2)
    block_size = k_ref.shape[1]
    kv_len = kv_lens_ref[seq]
    pos = kv_len - 1
    rows = q_ref.shape[0]
    row_ok = (jnp.arange(rows, dtype=jnp.int32) < group)[:, None]
    first, end = _split_range(split, split_pages_ref[0], kv_len, sliding_window, block_size)

    @pl.when(first < end)  # an empty split writes nothing; the merge leaves it out
    def _():
        acc, m, l = _stream_kv(  # noqa: E741
            q_ref[...],
            jnp.full((rows, 1), pos, jnp.int32),
            row_ok,
            tables_ref,
            seq,
            k_ref,
            v_ref,
            first,
            end,
            pages_per_step=pages_per_step,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            scale_refs=scale_refs,
            slopes=None if slopes_ref is None else slopes_ref[...][:, None],
        )
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _split_pages(longest, splits: int, pages_per_step: int, most: int):
    """Pages per decode split for a call whose longest sequence has `longest` blocks: an even
    share in whole steps, between one step and the static bound `most`."""
    share = _cdiv(_cdiv(longest, splits), pages_per_step) * pages_per_step
    return jnp.clip(share, pages_per_step, most).astype(jnp.int32)


def _split_range(split, split_pages, kv_len, sliding_window, block_size):
    """Blocks [first, end) of a sequence that decode split `split` reads (empty: first >= end).
    The same arithmetic runs in the kernel and, batched, in the merge."""
    lo = split * split_pages
    first = jnp.maximum(lo, _first_page(kv_len - 1, sliding_window, block_size))
    end = jnp.minimum(lo + split_pages, _cdiv(kv_len, block_size))
    return first, end


def _prefill_kernel(
    tile_seq_ref,  # int32 [NT]  sequence of each tile
    tile_off_ref,  # int32 [NT]  first query offset of the tile in its sequence, -1 = none
    kv_lens_ref,  # int32 [S]
    q_lens_ref,  # int32 [S]
    tables_ref,  # int32 [S, P_pad]
    q_ref,  # [TQ * Gp, D]
    k_ref,  # [NB, B, D]
    v_ref,  # [NB, B, D]
    *refs,  # [k_scales, v_scales (f32 [NB, B]) if quantized], [slopes f32 [TQ * Gp] if
    # alibi], [limits int32 [TQ * Gp], furthest int32 [NT] if limits], o [TQ * Gp, D]
    tokens: int,
    group_pad: int,
    pages_per_step: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized: bool = False,
    alibi: bool = False,
    limits: bool = False,
):
    scale_refs, slopes_ref, refs = _split_refs(refs, quantized, alibi)
    (limits_ref, furthest_ref), (o_ref,) = (refs[:2], refs[2:]) if limits else ((None, None), refs)
    tile = pl.program_id(0)
    block_size = k_ref.shape[1]
    seq = tile_seq_ref[tile]
    off = tile_off_ref[tile]
    q_len = q_lens_ref[seq]
    kv_len = kv_lens_ref[seq]
    # Rows of the last query token are the decode kernel's: this tile covers the
    # `n_rows` query tokens off .. off + n_rows - 1 before it.
    n_rows = jnp.where(off >= 0, jnp.minimum(tokens, q_len - 1 - off), 0)
    pos0 = kv_len - q_len + off
    m_rows = q_ref.shape[0]
    token = jnp.arange(m_rows, dtype=jnp.int32)[:, None] // group_pad  # [M, 1]
    pos = pos0 + token
    row_ok = token < n_rows
    first = _first_page(pos0, sliding_window, block_size)
    furthest = pos0 + n_rows - 1 if furthest_ref is None else furthest_ref[tile]
    end = jnp.where(n_rows > 0, furthest // block_size + 1, first)
    acc, _, l = _stream_kv(  # noqa: E741
        q_ref[...],
        pos,
        row_ok,
        tables_ref,
        seq,
        k_ref,
        v_ref,
        first,
        end,
        pages_per_step=pages_per_step,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        scale_refs=scale_refs,
        slopes=None if slopes_ref is None else slopes_ref[...][:, None],
        last=None if limits_ref is None else limits_ref[...][:, None],
    )
    l = jnp.where(l > 0, l, 1.0)  # noqa: E741
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _full_spec(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _pool_spec(num_blocks, block_size, head_dim):
    """The whole pool, seen through one KV head (grid axis 1)."""
    return pl.BlockSpec(
        (num_blocks, block_size, _SQUEEZED, head_dim), lambda i, h, *_: (0, 0, h, 0)
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "max_q_len",
        "config",
    ),
)
def ragged_paged_attention_pallas(
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
    interpret: bool = False,
    max_q_len: int | None = None,
    config: PallasConfig | None = None,
    k_scales: jax.Array | None = None,  # float32 [NB, B, Hkv]: with an 8-bit pool
    v_scales: jax.Array | None = None,  # float32 [NB, B, Hkv]
    alibi_slopes: jax.Array | None = None,  # float32 [Hq]: ALiBi
    causal_limits: jax.Array | None = None,  # int32 [T]: the last key position per row
) -> jax.Array:  # [T, Hq, D]
    """See `jaxpaged.kernels.ragged_paged_attention` (inputs are validated there); `config`
    defaults to `choose_config` for the shape. ALiBi slopes reach each kernel as one more
    input: per KV head, the slope of every matmul row (its query head's; padding rows 0).
    ``causal_limits`` reach the prefill kernel only (a sequence's last row, the decode
    kernel's, sees its whole sequence anyway): each matmul row's last visible key and each
    tile's furthest, where its blocks end."""
    _ignore_triton_deprecation()
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    max_seqs, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    group_pad = _pow2_at_least(group)
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"pallas backend needs head_dim a power of two >= 16, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"pallas backend needs block_size a power of two, got {block_size}")
    if config is None:
        config = choose_config(
            head_dim=head_dim,
            # an 8-bit pool's tiles are held dequantized, in the query's dtype
            itemsize=(q.dtype if k_scales is not None else k_pages.dtype).itemsize,
            block_size=block_size,
            group_pad=group_pad,
        )
    pages_per_step = _pages_per_step(config, block_size)
    quantized = k_scales is not None
    # an 8-bit pool's tiles are dequantized to the query's dtype in the kernels
    compute_dtype = q.dtype if quantized else k_pages.dtype
    qc = q.astype(compute_dtype)
    num_seqs = jnp.reshape(num_seqs, (-1,))[0]

    seq_ids = jnp.arange(max_seqs, dtype=jnp.int32)
    seq_valid = seq_ids < num_seqs
    q_start = cu_q_lens[:-1]
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - q_start, 0)  # [S]
    kv_lens = jnp.where(seq_valid & (q_lens > 0), kv_lens, 0)
    # Table entries past a sequence's last block may hold anything: point them at block
    # 0 so no gather leaves the pool; pad so every step's window of pages is in range.
    n_pages = _cdiv(kv_lens, block_size)
    col = jnp.arange(max_pages, dtype=jnp.int32)
    tables = jnp.where(col[None, :] < n_pages[:, None], block_tables, 0)
    common = dict(
        pages_per_step=pages_per_step,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        quantized=quantized,
        alibi=alibi_slopes is not None,
    )
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    prefill_params = plgpu.CompilerParams(
        num_warps=config.prefill_warps, num_stages=config.prefill_stages
    )
    pool_spec = _pool_spec(num_blocks, block_size, head_dim)
    # the pool's arrays as the kernels read them: K, V and, for an 8-bit pool, their scales
    pools, pool_specs = (k_pages, v_pages), [pool_spec, pool_spec]
    if quantized:
        scale_spec = pl.BlockSpec((num_blocks, block_size, _SQUEEZED), lambda i, h, *_: (0, 0, h))
        pools += (k_scales, v_scales)
        pool_specs += [scale_spec, scale_spec]

    # --- decode kernel: last row of every sequence --------------------------------
    rows = max(16, group_pad)
    slopes = None  # [Hkv, Gp] float32: ALiBi slope of each (KV head, padded group row)
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
        slopes = jnp.pad(slopes, ((0, 0), (0, group_pad - group)))
    decode_in, decode_specs = (), []
    if slopes is not None:
        decode_in = (jnp.pad(slopes, ((0, 0), (0, rows - group_pad))),)
        decode_specs = [pl.BlockSpec((_SQUEEZED, rows), lambda s, h, k: (h, 0))]
    if config.num_splits is not None:
        splits = config.num_splits
    else:
        splits = max(1, config.target_programs // (max_seqs * num_kv_heads))
    splits = max(1, min(splits, _cdiv(max_pages, pages_per_step)))
    pages_per_split = _cdiv(_cdiv(max_pages, splits), pages_per_step) * pages_per_step
    splits = _cdiv(max_pages, pages_per_split)
    width = splits * pages_per_split + pages_per_step
    tables = jnp.pad(tables, ((0, 0), (0, width - max_pages)))
    # The splits share the longest real context of this call, not the table's width: with a
    # long max_model_len and short contexts every split still gets work. A runtime scalar,
    # never above the static pages_per_split, so the table padding above covers it.
    split_pages = _split_pages(jnp.max(n_pages), splits, pages_per_step, pages_per_split)

    last_row = jnp.clip(q_start + q_lens - 1, 0, num_tokens - 1)  # [S]
    qd = qc[last_row].reshape(max_seqs, num_kv_heads, group, head_dim)
    qd = jnp.pad(qd, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [S, Hkv, BH, D]
    o_part, m_part, l_part = pl.pallas_call(
        functools.partial(_decode_kernel, group=group, **common),
        grid=(max_seqs, num_kv_heads, splits),
        in_specs=[
            _full_spec((1,)),
            _full_spec((max_seqs,)),
            _full_spec((max_seqs, width)),
            pl.BlockSpec((_SQUEEZED, _SQUEEZED, rows, head_dim), lambda s, h, k: (s, h, 0, 0)),
            *pool_specs,
            *decode_specs,
        ],
        out_specs=[
            pl.BlockSpec(
                (_SQUEEZED, _SQUEEZED, _SQUEEZED, rows, head_dim),
                lambda s, h, k: (s, h, k, 0, 0),
            ),
            pl.BlockSpec((_SQUEEZED, _SQUEEZED, _SQUEEZED, rows), lambda s, h, k: (s, h, k, 0)),
            pl.BlockSpec((_SQUEEZED, _SQUEEZED, _SQUEEZED, rows), lambda s, h, k: (s, h, k, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((max_seqs, num_kv_heads, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((max_seqs, num_kv_heads, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((max_seqs, num_kv_heads, splits, rows), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="jaxpaged_decode_attention",
    )(split_pages[None], kv_lens, tables, qd, *pools, *decode_in)
    # Merge the splits (flash-decoding): weights exp(m_k - max_k m_k) over the splits that
    # ran; the others' outputs were never written and are not read.
    first, end = _split_range(
        jnp.arange(splits, dtype=jnp.int32)[None, :],
        split_pages,
        kv_lens[:, None],
        sliding_window,
        block_size,
    )
    ran = (first < end)[:, None, :, None]  # [S, 1, K, 1]
    m_part = jnp.where(ran, m_part, MASK_VALUE)
    l_part = jnp.where(ran, l_part, 0.0)
    o_part = jnp.where(ran[..., None], o_part, 0.0)
    m_all = m_part.max(axis=2, keepdims=True)
    w = jnp.where(l_part > 0, jnp.exp(m_part - m_all), 0.0)  # [S, Hkv, K, BH]
    denom = (l_part * w).sum(axis=2)
    out_last = (o_part * w[..., None]).sum(axis=2) / jnp.where(denom > 0, denom, 1.0)[..., None]
    out_last = out_last[:, :, :group]  # [S, Hkv, G, D]
    dest = jnp.where(q_lens > 0, last_row, num_tokens)
    out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
    out = out.at[dest].set(out_last, mode="drop", unique_indices=True)

    # --- prefill kernel: the other rows, in tiles of `tokens` rows of one sequence ----
    if max_q_len is None or max_q_len > 1:
        m_rows = _prefill_rows(config, group_pad)
        tokens = m_rows // group_pad
        bound = num_tokens if max_q_len is None else min(num_tokens, max_q_len)
        body_len = jnp.maximum(q_lens - 1, 0)
        tiles_per_seq = _cdiv(body_len, tokens)
        tile_end = jnp.cumsum(tiles_per_seq)
        num_tiles = min(num_tokens - 1, _cdiv(num_tokens, tokens) + max_seqs)
        num_tiles = min(num_tiles, max_seqs * _cdiv(bound - 1, tokens))
        if num_tiles > 0:
            t_ids = jnp.arange(num_tiles, dtype=jnp.int32)
            t_seq = jnp.minimum(jnp.searchsorted(tile_end, t_ids, side="right"), max_seqs - 1)
            t_seq = t_seq.astype(jnp.int32)
            t_off = (t_ids - (tile_end[t_seq] - tiles_per_seq[t_seq])) * tokens
            t_off = jnp.where(t_ids < tile_end[-1], t_off, -1).astype(jnp.int32)
            offs = jnp.maximum(t_off, 0)[:, None] + jnp.arange(tokens, dtype=jnp.int32)
            row_ok = (t_off[:, None] >= 0) & (offs < body_len[t_seq][:, None])  # [NT, TQ]
            src = jnp.clip(q_start[t_seq][:, None] + offs, 0, num_tokens - 1)
            qt = qc[src].reshape(num_tiles, tokens, num_kv_heads, group, head_dim)
            qt = jnp.pad(qt, ((0, 0), (0, 0), (0, 0), (0, group_pad - group), (0, 0)))
            qt = qt.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, m_rows, head_dim)
            tile_spec = pl.BlockSpec(
                (_SQUEEZED, _SQUEEZED, m_rows, head_dim), lambda t, h: (t, h, 0, 0)
            )
            prefill_in, prefill_specs = (), []
            if slopes is not None:  # row m of a tile is group row m % Gp
                prefill_in = (jnp.tile(slopes, (1, tokens)),)  # [Hkv, TQ * Gp]
                prefill_specs = [pl.BlockSpec((_SQUEEZED, m_rows), lambda t, h: (h, 0))]
            if causal_limits is not None:
                t_kv = kv_lens[t_seq][:, None]
                prefill_in += _tile_limits(
                    causal_limits, src, t_kv - q_lens[t_seq][:, None] + offs, t_kv, row_ok,
                    group_pad,
                )  # fmt: skip
                prefill_specs += [
                    pl.BlockSpec((_SQUEEZED, m_rows), lambda t, h: (t, 0)),
                    _full_spec((num_tiles,)),
                ]
            res = pl.pallas_call(
                functools.partial(
                    _prefill_kernel,
                    tokens=tokens,
                    group_pad=group_pad,
                    limits=causal_limits is not None,
                    **common,
                ),  # fmt: skip
                grid=(num_tiles, num_kv_heads),
                in_specs=[
                    _full_spec((num_tiles,)),
                    _full_spec((num_tiles,)),
                    _full_spec((max_seqs,)),
                    _full_spec((max_seqs,)),
                    _full_spec((max_seqs, width)),
                    tile_spec,
                    *pool_specs,
                    *prefill_specs,
                ],
                out_specs=tile_spec,
                out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
                compiler_params=prefill_params,
                interpret=interpret,
                name="jaxpaged_prefill_attention",
            )(t_seq, t_off, kv_lens, q_lens, tables, qt, *pools, *prefill_in)
            res = res.reshape(num_tiles, num_kv_heads, tokens, group_pad, head_dim)
            res = res[:, :, :, :group].transpose(0, 2, 1, 3, 4)  # [NT, TQ, Hkv, G, D]
            dest = jnp.where(row_ok, src, num_tokens).reshape(-1)
            out = out.at[dest].set(
                res.reshape(-1, num_kv_heads, group, head_dim).astype(jnp.float32),
                mode="drop",
                unique_indices=True,
            )

    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
