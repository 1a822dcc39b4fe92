"""Random ragged paged-attention problems for tests and benchmarks (numpy; JAX is imported
only by `run_and_compare`, which runs a backend against the reference).

A case places each sequence's KV in randomly chosen, non-contiguous physical blocks,
fills every slot no sequence owns (tails of partly filled blocks, spare blocks) with
large garbage, points unused block-table entries at random blocks, and makes padding
query rows NaN, so that any masking mistake shows up as a large error or a NaN.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Relative error (norm of difference over norm of reference) each dtype must meet.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref||, computed in float64."""
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One problem in the kernel layout of docs/architecture.md, as numpy arrays."""

    q: np.ndarray  # [T, Hq, D]
    k_pages: np.ndarray  # [NB, B, Hkv, D]
    v_pages: np.ndarray  # [NB, B, Hkv, D]
    kv_lens: np.ndarray  # int32 [S]
    block_tables: np.ndarray  # int32 [S, P]
    cu_q_lens: np.ndarray  # int32 [S + 1]
    num_seqs: np.ndarray  # int32 [1]
    sm_scale: float
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) of the real sequences

    def args(self):
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            self.kv_lens,
            self.block_tables,
            self.cu_q_lens,
            self.num_seqs,
        )


def make_case(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per sequence; q_len <= kv_len
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=np.float32,
    max_seqs: int | None = None,
    pad_tokens: int = 0,
    extra_table_cols: int = 1,
    spare_blocks: int = 2,
    garbage_tail_meta: bool = True,
) -> Case:
    """Build a case; `dtype` may be a numpy or ml_dtypes (bfloat16) type."""
    for q_len, kv_len in seqs:
        if not 0 <= q_len <= kv_len:
            raise ValueError(f"need 0 <= q_len <= kv_len, got {(q_len, kv_len)}")
    n = len(seqs)
    max_seqs = n if max_seqs is None else max_seqs
    nblk = [math.ceil(kv / block_size) for _, kv in seqs]
    cols = max(nblk + [1]) + extra_table_cols
    num_blocks = sum(nblk) + spare_blocks
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = rng.integers(0, num_blocks, size=(max_seqs, cols), dtype=np.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    garbage = 1e3
    k_pages = (rng.standard_normal(shape) * garbage).astype(np.float32)
    v_pages = (rng.standard_normal(shape) * garbage).astype(np.float32)
    used = 0
    for i, ((_, kv_len), nb) in enumerate(zip(seqs, nblk, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        tables[i, :nb] = ids
        for b, blk in enumerate(ids):
            fill = min(block_size, kv_len - b * block_size)
            k_pages[blk, :fill] = rng.standard_normal((fill, num_kv_heads, head_dim))
            v_pages[blk, :fill] = rng.standard_normal((fill, num_kv_heads, head_dim))
    q_lens = np.array([ql for ql, _ in seqs], dtype=np.int32)
    total = int(q_lens.sum())
    q = rng.standard_normal((total + pad_tokens, num_q_heads, head_dim)).astype(np.float32)
    q[total:] = np.nan
    cu = np.zeros(max_seqs + 1, dtype=np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = total
    kv_lens = np.zeros(max_seqs, dtype=np.int32)
    kv_lens[:n] = [kv for _, kv in seqs]
    if garbage_tail_meta and max_seqs > n:
        # Entries past num_seqs are unspecified by the interface: make them nonsense.
        cu[n + 1 :] = rng.integers(0, total + pad_tokens + 1, size=max_seqs - n)
        kv_lens[n:] = rng.integers(0, cols * block_size + 1, size=max_seqs - n)
    return Case(
        q=q.astype(dtype),
        k_pages=k_pages.astype(dtype),
        v_pages=v_pages.astype(dtype),
        kv_lens=kv_lens,
        block_tables=tables,
        cu_q_lens=cu,
        num_seqs=np.array([n], dtype=np.int32),
        sm_scale=1.0 / math.sqrt(head_dim),
        seqs=tuple(seqs),
    )


def numpy_attention(
    case: Case,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: np.ndarray | None = None,  # [Hq]
    spans: dict[int, tuple[int, int]] | None = None,  # row -> [lo, hi) positions it sees whole
) -> np.ndarray:  # [T, Hq, D] float64
    """Independent float64 loop-per-sequence attention, to check the jnp reference (ALiBi as
    transformers' BLOOM writes it: slope * key position, which softmax makes relative).
    ``spans``: a row inside a bidirectional span also sees the span's later keys (the
    sliding window still bounds it below, as transformers' Gemma 3 mask does)."""
    q = case.q.astype(np.float64)
    k_pages = case.k_pages.astype(np.float64)
    v_pages = case.v_pages.astype(np.float64)
    _, block_size, hkv, d = k_pages.shape
    group = q.shape[1] // hkv
    out = np.zeros_like(q)
    for i, (q_len, kv_len) in enumerate(case.seqs):
        ids = case.block_tables[i]
        k = k_pages[ids].reshape(-1, hkv, d)[:kv_len]
        v = v_pages[ids].reshape(-1, hkv, d)[:kv_len]
        for j in range(q_len):
            row = case.cu_q_lens[i] + j
            pos = kv_len - q_len + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            last = max(pos, spans[row][1] - 1) if spans and row in spans else pos
            for h in range(q.shape[1]):
                kh = k[lo : last + 1, h // group]
                s = kh @ q[row, h] * case.sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                if alibi_slopes is not None:
                    s = s + float(alibi_slopes[h]) * np.arange(lo, last + 1)
                p = np.exp(s - s.max())
                out[row, h] = (p / p.sum()) @ v[lo : last + 1, h // group]
    return out


# (head_dim, block_size, num_q_heads, num_kv_heads, dtype, sliding_window, soft_cap): each
# value of every axis appears, without the full product.
SWEEP = [
    (64, 16, 9, 3, "float32", None, None),  # SmolLM2
    (64, 8, 4, 4, "float32", 7, None),  # MHA
    (128, 32, 8, 1, "float32", None, None),  # MQA, ratio 8
    (64, 64, 4, 2, "bfloat16", None, 3.0),
    (128, 16, 8, 2, "bfloat16", None, None),
    (64, 32, 8, 2, "float16", 20, 5.0),
    (256, 8, 2, 1, "float32", None, None),
]


def mixed_seqs(rng, block_size, n=6):
    """Decode rows, prefill from scratch, chunked prefill on a cached prefix."""
    seqs = []
    for i in range(n):
        kind = i % 3
        kv = int(rng.integers(1, 5 * block_size))
        if kind == 0:  # decode
            seqs.append((1, kv))
        elif kind == 1:  # prefill from scratch
            seqs.append((kv, kv))
        else:  # chunked prefill on top of a cached prefix
            seqs.append((int(rng.integers(1, kv + 1)), kv))
    rng.shuffle(seqs)
    return [tuple(s) for s in seqs]


def random_spans(
    rng: np.random.Generator, case: Case, num_rows: int
) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:  # int32 [T], row -> [lo, hi)
    """Bidirectional spans (an image's tokens) inside each multi-row query chunk, and the
    ``causal_limits`` they give: a span's rows see up to its last position, other rows their
    own (some written as anything below it, which must not hide a key); padding rows get
    garbage, which the clamp must make harmless. Returns (limits, row -> span positions)."""
    limits = rng.integers(-(2**30), 2**30, size=num_rows).astype(np.int32)
    spans: dict[int, tuple[int, int]] = {}
    for i, (q_len, kv_len) in enumerate(case.seqs):
        first = int(case.cu_q_lens[i])
        pos0 = kv_len - q_len
        for j in range(q_len):
            pos = pos0 + j
            limits[first + j] = pos if rng.random() < 0.7 else int(rng.integers(-5, pos + 1))
        j = 0
        while q_len > 1 and j < q_len - 1:
            j += int(rng.integers(0, 4))
            width = int(rng.integers(2, 12))
            lo, hi = j, min(q_len, j + width)
            if hi - lo < 2:
                break
            for r in range(lo, hi):
                limits[first + r] = pos0 + hi - 1
                spans[first + r] = (pos0 + lo, pos0 + hi)
            j = hi
    return limits, spans


def run_and_compare(
    rng, seqs, *, hq, hkv, d, bs, dtype, backend, max_seqs=None, pad=3, **kw
) -> Case:
    """Run `backend` (or `fn=`) on a fresh random case and check it against the reference:
    relative error under TOLERANCE[dtype] and padding rows exactly zero."""
    import jax.numpy as jnp

    from .attention import ragged_paged_attention

    case = make_case(
        rng,
        seqs,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=DTYPES[dtype],
        max_seqs=max_seqs,
        pad_tokens=pad,
    )
    args = tuple(map(jnp.asarray, case.args()))
    opts = dict(
        sm_scale=case.sm_scale,
        sliding_window=kw.pop("sliding_window", None),
        soft_cap=kw.pop("soft_cap", None),
    )
    if kw.get("alibi_slopes") is not None:  # the same slopes for the reference
        opts["alibi_slopes"] = jnp.asarray(kw.pop("alibi_slopes"), jnp.float32)
    if kw.pop("causal_limits", False):  # random bidirectional spans, the same for both
        limits, _ = random_spans(rng, case, case.q.shape[0])
        opts["causal_limits"] = jnp.asarray(limits)
    ref = ragged_paged_attention(*args, **opts, backend="reference")
    fn = kw.pop("fn", None)
    if fn is None:
        out = ragged_paged_attention(*args, **opts, backend=backend, **kw)
    else:
        out = fn(*args, **opts, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"rel err {err} for {seqs}"
    total = sum(q for q, _ in case.seqs)
    assert np.all(np.asarray(out).astype(np.float32)[total:] == 0.0), "padding rows not zero"
    return case
