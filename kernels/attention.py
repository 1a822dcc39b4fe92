"""Public ragged paged attention: validates shapes, picks a backend, dispatches.

Backends: "reference" (pure jnp, the semantics), "cpu" (native C++ kernel through XLA
FFI, default on CPU when it builds), "xla" (gathers + einsums: the CPU fallback), "pallas"
(Pallas Triton kernel, default on NVIDIA GPUs; `interpret=True` runs it anywhere, for tests),
"tpu" (JAX's own TPU kernel over a combined K/V pool, default on TPUs; interpret mode off a
TPU). An engine's backend, its pool layout and its fallbacks are chosen once, in its
:class:`~jaxpaged.kernels.platform.Platform`; ``backend=None`` serves direct callers.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from . import cpu
from .kv_quant import check_scales, is_quantized
from .reference import ragged_paged_attention_reference
from .xla import ragged_paged_attention_xla

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "xla", "pallas", "cpu", "tpu")
LIMITLESS_BACKENDS = ("tpu",)  # no per-row causal limits (an image's bidirectional span)
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def default_backend(platform: str | None = None) -> str:
    """The backend used when `backend=None`: "pallas" on NVIDIA GPUs, "tpu" on TPUs, "cpu" on
    CPUs where the native kernel builds, else "xla"."""
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda"):
        return "pallas"
    if platform == "tpu":
        return "tpu"
    if platform == "cpu" and cpu.available():
        return "cpu"
    return "xla"


def refuse_causal_limits(backend: str) -> None:
    """The ValueError of a backend without per-row causal limits."""
    raise ValueError(
        f"attention backend {backend!r} does not take causal_limits (the bidirectional "
        "attention over an image's tokens that Gemma 3 needs): use 'pallas', 'cpu', 'xla' "
        "or 'reference'"
    )


def fallback_reason(
    backend: str,
    *,
    q_dtype,
    kv_dtype,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    interpret: bool = False,
) -> str | None:
    """Why ``backend`` cannot run attention of these shapes and dtypes where the "xla" path
    can, as far as is known without compiling (None: nothing known). The one rule behind a
    direct caller's ``backend=None`` and an engine's Platform (kernels/platform.py).
    ``kv_dtype``: the pool's values (int8 / float8_e4m3fn: quantized, read in ``q_dtype``)."""
    if backend == "cpu" and not cpu.supports(q_dtype, kv_dtype):
        return (
            "the native kernel reads float32 or bfloat16 queries over a float32, bfloat16 or "
            f"8-bit pool, not {jnp.dtype(q_dtype)} over {jnp.dtype(kv_dtype)}"
        )
    if backend == "pallas" and not interpret:
        from .pallas_gpu import unsupported_reason

        quantized = is_quantized(jnp.dtype(kv_dtype))
        return unsupported_reason(
            head_dim=head_dim,
            itemsize=jnp.dtype(q_dtype if quantized else kv_dtype).itemsize,
            block_size=block_size,
            group_pad=1 << max(0, (num_q_heads // num_kv_heads - 1).bit_length()),
        )
    return None


def validate_inputs(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [NB, B, Hkv, D]
    v_pages: jax.Array,  # [NB, B, Hkv, D]
    kv_lens: jax.Array,  # int32 [S]
    block_tables: jax.Array,  # int32 [S, P]
    cu_q_lens: jax.Array,  # int32 [S + 1]
    num_seqs: jax.Array,  # int32 scalar or [1]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scales: jax.Array | None = None,  # float32 [NB, B, Hkv]: with an 8-bit pool
    v_scales: jax.Array | None = None,  # float32 [NB, B, Hkv]
    alibi_slopes: jax.Array | None = None,  # float32 [Hq]
    causal_limits: jax.Array | None = None,  # int32 [T]
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or value is inconsistent."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            "k_pages must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} must equal k_pages dtype {k_pages.dtype}")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, kv_head_dim = k_pages.shape[2:]
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) differs from k_pages/v_pages ({kv_head_dim})")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    check_scales(k_pages, k_scales, v_scales)
    for name, x in (("q", q), ("k_pages", k_pages)):
        if name == "k_pages" and is_quantized(x.dtype):
            continue
        if not any(x.dtype == d for d in _FLOATS):
            raise ValueError(
                f"{name} dtype must be float32, bfloat16 or float16"
                + (" (or int8 / float8_e4m3fn with scales)" if name == "k_pages" else "")
                + f", got {x.dtype}"
            )
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be [max_num_seqs], got shape {kv_lens.shape}")
    max_seqs = kv_lens.shape[0]
    if max_seqs < 1:
        raise ValueError("kv_lens must have at least one entry (max_num_seqs >= 1)")
    if block_tables.ndim != 2 or block_tables.shape[0] != max_seqs:
        raise ValueError(
            f"block_tables must be [max_num_seqs={max_seqs}, max_blocks_per_seq], "
            f"got shape {block_tables.shape}"
        )
    if block_tables.shape[1] < 1:
        raise ValueError("block_tables must have at least one column")
    if cu_q_lens.shape != (max_seqs + 1,):
        raise ValueError(
            f"cu_q_lens must be [max_num_seqs + 1 = {max_seqs + 1}], got shape {cu_q_lens.shape}"
        )
    if num_seqs.shape not in ((), (1,)):
        raise ValueError(f"num_seqs must be a scalar or [1], got shape {num_seqs.shape}")
    for name, x in (
        ("kv_lens", kv_lens),
        ("block_tables", block_tables),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive float, got {sm_scale}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap}")
    if causal_limits is not None and (
        causal_limits.shape != (q.shape[0],) or causal_limits.dtype != jnp.int32
    ):
        raise ValueError(
            f"causal_limits must be int32 [num_tokens={q.shape[0]}], "
            f"got {causal_limits.dtype} {causal_limits.shape}"
        )
    if alibi_slopes is not None and (
        alibi_slopes.shape != (num_q_heads,) or alibi_slopes.dtype != jnp.float32
    ):
        raise ValueError(
            f"alibi_slopes must be float32 [num_q_heads={num_q_heads}], "
            f"got {alibi_slopes.dtype} {alibi_slopes.shape}"
        )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "backend",
        "interpret",
        "max_q_len",
        "max_kv_len",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32 [max_num_seqs]
    block_tables: jax.Array,  # int32 [max_num_seqs, max_blocks_per_seq]
    cu_q_lens: jax.Array,  # int32 [max_num_seqs + 1]
    num_seqs: jax.Array,  # int32 scalar or [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    k_scales: jax.Array | None = None,  # float32 [num_blocks, block_size, num_kv_heads]
    v_scales: jax.Array | None = None,  # float32 [num_blocks, block_size, num_kv_heads]
    alibi_slopes: jax.Array | None = None,  # float32 [num_q_heads]
    causal_limits: jax.Array | None = None,  # int32 [num_tokens]
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim]
    """Causal GQA attention of ragged query rows over a paged KV pool.

    Query token j of sequence i is row `cu_q_lens[i] + j`, at position
    `kv_lens[i] - q_len_i + j`, and sees cached positions `0..position` (only the last
    `sliding_window` of them if set); logits are `sm_scale * q.k`, then
    `soft_cap * tanh(logits / soft_cap)` if set. Rows from `cu_q_lens[num_seqs]` on are
    padding and come out as zeros. Query head h reads KV head h // (Hq // Hkv).

    Optional static hints (any backend may ignore them; the result is the same when
    they hold, undefined when they do not): `max_q_len`, an upper bound on every
    sequence's query length (1 for a decode-only step), and `max_kv_len`, an upper bound
    on kv_lens. `interpret` runs the Pallas kernel in interpret mode (CPU tests).

    An int8 or float8_e4m3fn pool comes with `k_scales`/`v_scales`, one float32 scale per
    (token, KV head): a row's value is its stored value times its scale (kv_quant.py).

    ``alibi_slopes`` (ALiBi, as BLOOM) adds ``slopes[h] * (key_pos - query_pos)`` to head h's
    logits after the scale and soft cap. Whether it is given is part of the compiled program
    (None traces exactly the program without it). JAX's TPU kernel takes no bias: "tpu"
    refuses it.

    ``causal_limits`` (a vision model's image tokens, which attend to their whole image):
    row t sees keys up to ``causal_limits[t]`` instead of up to its position, clamped to at
    least its position and at most its sequence's last (`reference.clamp_limits`); the
    sliding window's lower bound stays relative to the position (transformers' Gemma 3 mask
    with ``token_type_ids``). Whether it is given is part of the compiled program. "cpu",
    "xla", "pallas" and "reference" take it; "tpu" (JAX's own kernel) refuses it
    (`refuse_causal_limits`).
    """
    validate_inputs(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
        alibi_slopes=alibi_slopes,
        causal_limits=causal_limits,
    )
    quantized = k_scales is not None
    if backend is None:  # a direct caller's default; an engine passes its Platform's choice
        backend = "pallas" if interpret else default_backend()
        reason = fallback_reason(
            backend,
            q_dtype=q.dtype,
            kv_dtype=k_pages.dtype,
            num_q_heads=q.shape[1],
            num_kv_heads=k_pages.shape[2],
            head_dim=q.shape[2],
            block_size=k_pages.shape[1],
            interpret=bool(interpret),
        )
        if reason is not None:
            if backend == "pallas":  # traced once per program, so this warns once per shape
                logger.warning("Pallas attention cannot run this shape (%s): using XLA", reason)
            backend = "xla"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    extra = dict(k_scales=k_scales, v_scales=v_scales) if quantized else {}
    if alibi_slopes is not None:
        if backend == "tpu":
            from .tpu import refuse_alibi

            refuse_alibi()
        extra["alibi_slopes"] = alibi_slopes  # passed on only when given
    if causal_limits is not None:
        if backend in LIMITLESS_BACKENDS:
            refuse_causal_limits(backend)
        extra["causal_limits"] = causal_limits
    if backend == "reference":
        return ragged_paged_attention_reference(*args, **opts, **extra)
    if backend == "xla":
        return ragged_paged_attention_xla(
            *args, **opts, max_q_len=max_q_len, max_kv_len=max_kv_len, **extra
        )
    if backend == "cpu":
        return cpu.ragged_paged_attention_native(*args, **opts, **extra)
    if backend == "tpu":
        from .tpu import combine_kv, ragged_paged_attention_tpu, refuse_quantized

        refuse_quantized(k_pages.dtype)

        # separate K and V pools are combined here (a copy); the engine keeps its pool combined
        # and calls ragged_paged_attention_tpu directly (pool_format.py)
        kv_pages = combine_kv(k_pages, v_pages)
        return ragged_paged_attention_tpu(
            q, kv_pages, *args[3:], **opts, num_kv_heads=k_pages.shape[2], interpret=interpret
        )
    from .pallas_gpu import ragged_paged_attention_pallas

    return ragged_paged_attention_pallas(
        *args, **opts, interpret=bool(interpret), max_q_len=max_q_len, **extra
    )
