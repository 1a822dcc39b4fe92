"""Native CPU kernels called through XLA FFI: ragged paged attention (cpu_native.cc),
linear layers over weights in panel layout (cpu_linear.cc; int8-quantized weights in
cpu_linear_q8.cc, wrapped by linear_q8.py; group-wise 4- and 8-bit weights in
cpu_linear_q4.cc, wrapped by linear_q4.py) and greedy sampling's argmax (cpu_argmax.cc).

The C++ sources ship with the package and are compiled on first use with the system C++
compiler into `$JAXPAGED_CACHE/native/` (keyed by source, compiler flags and CPU), so
`pip install` needs no build step and the kernel is tuned for the machine it runs on.
When no compiler is found or the build fails, `available()` is False and callers use the
"xla" backend instead; `JAXPAGED_NATIVE=0` forces that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_HERE = Path(__file__).parent
_SOURCES = (
    _HERE / "cpu_native.cc",
    _HERE / "cpu_linear.cc",
    _HERE / "cpu_linear_q8.cc",
    _HERE / "cpu_linear_q4.cc",
    _HERE / "cpu_argmax.cc",
)
_HEADERS = (
    _HERE / "cpu_fused.h",
    _HERE / "cpu_linear_q4_512.h",
    _HERE / "cpu_linear_q4_lanes.h",
    _HERE / "cpu_linear_q4_i8.h",
    _HERE / "cpu_parallel.h",
    _HERE / "cpu_simd.h",
)
_TARGET = "jaxpaged_paged_attention"
_QUANT_TARGET = "jaxpaged_paged_attention_quant"  # 8-bit pools with per-(token, head) scales
_LINEAR_TARGET = "jaxpaged_linear"
_LINEAR_Q8_TARGET = "jaxpaged_linear_q8"
_LINEAR_Q4_TARGET = "jaxpaged_linear_q4"  # group-wise 4- and 8-bit weights
_WRITE_KV_TARGET = "jaxpaged_write_kv"
_ARGMAX_TARGET = "jaxpaged_argmax"
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-march=native", "-w")
_lock = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get("JAXPAGED_CACHE") or os.path.join("~", ".cache", "jaxpaged")
    return Path(root).expanduser() / "native"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [x for x in lines if x.startswith(("model name", "flags"))][:2]
    except OSError:
        keep = []
    return platform.machine() + "".join(keep)


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build() -> Path:
    """Compile the kernels once per (sources, flags, CPU); returns the shared library."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for path in (*_SOURCES, *_HEADERS):
        key.update(path.read_bytes())
    for part in (" ".join(_FLAGS), _cpu_signature()):
        key.update(part.encode())
    key.update(cxx.encode())
    out = _cache_dir() / f"kernels_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{include}", f"-I{_HERE}", *map(str, _SOURCES), "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{e.stderr[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _register() -> str | None:
    """Build, load and register the kernel once per process; the reason it failed, or None."""
    if os.environ.get("JAXPAGED_NATIVE", "1") == "0":
        return "disabled by JAXPAGED_NATIVE=0"
    try:
        with _lock:
            lib = ctypes.cdll.LoadLibrary(str(_build()))
            for name, fn in (
                (_TARGET, lib.JaxpagedPagedAttention),
                (_QUANT_TARGET, lib.JaxpagedPagedAttentionQuant),
                (_LINEAR_TARGET, lib.JaxpagedLinear),
                (_LINEAR_Q8_TARGET, lib.JaxpagedLinearQ8),
                (_LINEAR_Q4_TARGET, lib.JaxpagedLinearQ4),
                (_WRITE_KV_TARGET, lib.JaxpagedWriteKV),
                (_ARGMAX_TARGET, lib.JaxpagedArgmax),
            ):
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"jaxpaged: native CPU attention unavailable, using XLA: {e}", stacklevel=3)
        return str(e)
    return None


def _require(what: str) -> None:
    """Raises if the kernels did not build; ``what`` names the caller in the message."""
    reason = _register()
    if reason is not None:
        raise RuntimeError(f"native CPU {what} unavailable: {reason}")


def available() -> bool:
    """True when the native kernel is built and registered (builds it on first call)."""
    return _register() is None


_POOL_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn)))


def supports(q_dtype, kv_dtype) -> bool:
    """The kernel reads float32, bfloat16 and 8-bit (int8 / float8_e4m3fn, with scales) pools;
    queries are passed as float32."""
    return jnp.dtype(kv_dtype) in _POOL_DTYPES and (
        jnp.dtype(q_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    )


def ragged_paged_attention_native(
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
    k_scales: jax.Array | None = None,  # float32 [NB, B, Hkv]: with an 8-bit pool
    v_scales: jax.Array | None = None,  # float32 [NB, B, Hkv]
    alibi_slopes: jax.Array | None = None,  # float32 [Hq]: ALiBi, one more operand
    causal_limits: jax.Array | None = None,  # int32 [T]: the last key position per row
) -> jax.Array:  # [T, Hq, D]
    """The "cpu" backend: every row in the C++ kernel (decode rows and prefill tiles alike;
    bench/kernels.py has it against the XLA path). An 8-bit pool's rows are dequantized with
    their scales as the kernel reads them. ALiBi slopes travel as a trailing operand, so a
    call without them is the same custom call as before; so do ``causal_limits`` (each row
    sees keys up to its limit, clamped as `reference.clamp_limits`). Inputs are validated by
    `ragged_paged_attention`."""
    _require("attention")
    if not supports(q.dtype, k_pages.dtype):
        raise ValueError(f"backend 'cpu' needs float32/bfloat16 q and pages, got {k_pages.dtype}")
    if q.shape[2] > 256 or k_pages.shape[1] > 64:
        raise ValueError("backend 'cpu' supports head_dim <= 256 and block_size <= 64")
    pages = (k_pages, v_pages)
    if k_scales is None:
        call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    else:
        call = jax.ffi.ffi_call(_QUANT_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        pages += (k_scales, v_scales)
    out = call(
        q.astype(jnp.float32),
        *pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        jnp.reshape(num_seqs, (1,)),
        *(() if alibi_slopes is None else (alibi_slopes.astype(jnp.float32),)),
        *(() if causal_limits is None else (causal_limits.astype(jnp.int32),)),
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int64(sliding_window or 0),
    )
    return out.astype(q.dtype)


def write_kv_native(
    k_pages: jax.Array,  # [NB, B, Hkv, D]
    v_pages: jax.Array,  # [NB, B, Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slots: jax.Array,  # int32 [T]: flat slot per row; out of range = padding, skipped
) -> tuple[jax.Array, jax.Array]:  # (k_pages, v_pages)
    """`write_kv` as a C++ copy of the new rows into the donated pools (the outputs alias
    them). XLA:CPU runs a scatter into a 16-bit float pool by converting the whole pool to
    float32 and back, seconds per step; this moves only the rows. Inputs are validated by
    `write_kv`."""
    _require("kernels")
    call = jax.ffi.ffi_call(
        _WRITE_KV_TARGET,
        (
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),  # fmt: skip
        input_output_aliases={0: 0, 1: 1},
    )
    return call(k_pages, v_pages, k.astype(k_pages.dtype), v.astype(v_pages.dtype),
                slots.astype(jnp.int32))  # fmt: skip


PANEL = 16  # outputs per panel of the linear kernel's weight layout
LINEAR_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # of its x and weights


def pack_panels(w: jax.Array) -> jax.Array:  # [..., N, K] -> [..., N, K], panel layout
    """The linear kernel's layout of [out, in] weights: the same shape, each [N, K] matrix
    stored as [N/16, K, 16], so the 16 outputs of a panel have their weights contiguous at
    every k (see cpu_linear.cc)."""
    *lead, n, k = w.shape
    if n % PANEL:
        raise ValueError(f"pack_panels needs N % {PANEL} == 0, got weight shape {tuple(w.shape)}")
    return jnp.swapaxes(jnp.reshape(w, (*lead, n // PANEL, PANEL, k)), -1, -2).reshape(w.shape)


def unpack_panels(w: jax.Array) -> jax.Array:  # [..., N, K] panel layout -> [..., N, K]
    """The inverse of `pack_panels`."""
    *lead, n, k = w.shape
    return jnp.swapaxes(jnp.reshape(w, (*lead, n // PANEL, k, PANEL)), -1, -2).reshape(w.shape)


def linear(
    x: jax.Array,  # float32 or bfloat16 [M, K]
    w: jax.Array,  # float32 or bfloat16 [L, N, K]: every layer's [out, in] weight, panel layout
    layer: jax.Array | int,  # int32 []: which of the L weights
    *,
    num_rows: jax.Array | int | None = None,  # int32 []: rows of x that are real (default M)
    out_dtype: jnp.dtype | None = None,  # default: x's dtype
    residual: jax.Array | None = None,  # [M, N]: added to the product
    norm: tuple[jax.Array, float] | None = None,  # (weight [K], eps): RMSNorm x's rows first
    silu_gate: jax.Array | None = None,  # [M, K]: x becomes silu(silu_gate) * x, first of all
) -> jax.Array:  # [M, N]
    """x @ w[layer].T in the C++ kernel, with ``w`` from `pack_panels`. The layer is indexed
    inside the kernel, so the stacked weight is read in place (no per-layer slice copy).
    Rows from ``num_rows`` on come out zero and cost nothing: a step padded to its bucket
    pays for its real tokens only. bfloat16 weights are read as such (half the bytes of
    float32); x, the accumulation and the result are float32 inside. A ``residual`` is added
    as the result is stored (padding rows get the residual's rows); ``silu_gate`` (a SwiGLU
    MLP's activation) and ``norm`` (``weight * x / rms(x)``) apply to x's rows as they are
    packed, in float32: a decoder layer's activation, norms and skip connections without XLA
    passes of their own."""
    _require("kernels")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2] or w.shape[1] % PANEL:
        raise ValueError(
            f"linear needs x [M, K] and w [L, N, K] with N % {PANEL} == 0, "
            f"got {x.shape} and {w.shape}"
        )
    if jnp.dtype(x.dtype) not in LINEAR_DTYPES or jnp.dtype(w.dtype) not in LINEAR_DTYPES:
        raise ValueError(f"linear needs float32/bfloat16 x and w, got {x.dtype} and {w.dtype}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    y = jax.ffi.ffi_call(_LINEAR_TARGET, out)(
        x.astype(jnp.float32),
        w,
        *_fused_operands(x, out, layer, num_rows, residual, norm, silu_gate),
        norm_eps=np.float32(0.0 if norm is None else norm[1]),
    )
    return y.astype(out_dtype or x.dtype)


def _fused_operands(
    x: jax.Array,  # [M, K]
    out: jax.ShapeDtypeStruct,  # [M, N] float32
    layer: jax.Array | int,
    num_rows: jax.Array | int | None,
    residual: jax.Array | None,  # [M, N]
    norm: tuple[jax.Array, float] | None,  # (weight [K], eps)
    silu_gate: jax.Array | None,  # [M, K]
) -> tuple[jax.Array, ...]:
    """The operands after x and the weight that the native linear kernels take (layer, real
    rows, gate, norm weight, residual; an absent one as an empty float32 array), checked
    against x and the product's shape."""
    if residual is not None and residual.shape != out.shape:
        raise ValueError(f"residual must be {out.shape} like the product, got {residual.shape}")
    if silu_gate is not None and silu_gate.shape != x.shape:
        raise ValueError(f"silu_gate must be {x.shape} like x, got {silu_gate.shape}")
    if norm is not None and norm[0].shape != (x.shape[1],):
        raise ValueError(f"norm weight must be [{x.shape[1]}] like x's rows, got {norm[0].shape}")
    none = jnp.zeros((0,), jnp.float32)

    def scalar(v: jax.Array | int) -> jax.Array:  # int32 [1]
        return jnp.reshape(jnp.asarray(v, jnp.int32), (1,))

    return (
        scalar(layer),
        scalar(x.shape[0] if num_rows is None else num_rows),
        none if silu_gate is None else silu_gate.astype(jnp.float32),
        none if norm is None else norm[0].astype(jnp.float32),
        none if residual is None else residual.astype(jnp.float32),
    )


def argmax(x: jax.Array) -> jax.Array:  # float32 [R, V] -> int32 [R]
    """``jnp.argmax(x, axis=-1)`` in the C++ kernel (the first index of each row's maximum,
    or of its first NaN), for greedy sampling: XLA:CPU's index-tracking reduce is several
    times slower over a batch's logits (32 x 49152 float32: 1.8-1.9 ms against 0.4-0.5 ms
    for this kernel, 2-core Zen 4 VM)."""
    _require("argmax")
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"argmax needs x [R, V] with V >= 1, got shape {x.shape}")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"argmax needs float32 x, got {x.dtype}")
    call = jax.ffi.ffi_call(_ARGMAX_TARGET, jax.ShapeDtypeStruct(x.shape[:1], jnp.int32))
    return call(x)
