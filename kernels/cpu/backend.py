"""CpuBackend: every part of an engine that exists only on a CPU, chosen once per engine.

- The native kernels: paged attention (cpu_native.cc), every matmul (cpu_linear.cc) and greedy
  sampling's argmax (cpu_argmax.cc), used together when the "cpu" attention backend is in use
  on one device; int8-quantized weights take cpu_linear_q8.cc's matmul instead, and
  group-wise quantized ones (a GGUF model's) cpu_linear_q4.cc's.
- The matmul weights, repacked once into the native matmul's panel layout.
- The weights every step streams, moved onto 2 MiB pages (huge_pages.py).
- glibc malloc tuning (host_malloc.py): process-wide, so applied only when the caller asks
  (``configure_process``), before JAX starts.

Nothing here imports the model: the caller passes its weight map
(``(params, fn)`` -> params with ``fn`` applied to every matmul weight in its ``[L', out,
in]`` view: the worker's ModelHooks pairs a family's declared linears with the generic map
of models/linear.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from .. import cpu
from ..step_kernels import StepKernels, argmax_xla
from . import features, host_malloc, huge_pages
from .linear_q4 import is_grouped_weight, linear_q4
from .linear_q8 import is_int8_weight, linear_q8, pack_panels_q8

__all__ = ["CpuBackend", "WeightMap"]

# (params, fn) -> params with fn applied to every matmul weight's [L', out, in] view
WeightMap = Callable[[Any, Callable[[jax.Array], jax.Array]], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuBackend:
    """Which native kernels an engine on the CPU uses, and the CPU-only work around them."""

    native_attention: bool = False  # the "cpu" paged-attention backend
    native_linear: bool = False  # every matmul in cpu.linear, over weights in panel layout
    # with native_linear: every matmul weight is int8 with per-output scales (models/quant),
    # run by linear_q8 over q8 panels
    int8_weights: bool = False
    # with native_linear: the matmul weights mix kinds, group-wise quantized
    # (models/quant/grouped.py), int8 or float (e.g. an int8 model's float lm_head); each
    # runs in its own kernel (linear_q4, linear_q8 over q8 panels, or cpu.linear over panels)
    grouped_weights: bool = False
    native_argmax: bool = False  # greedy sampling in cpu.argmax
    # The hidden states' dtype between layers where it is not the params' (None: theirs).
    # cpu.linear computes in float32 on every CPU (it widens bfloat16 weights as it reads
    # them), so bfloat16 params under it keep float32 activations: bfloat16 storage, float32
    # compute, and no bfloat16 rounding and widening around every norm, rotary and residual
    # op (XLA:CPU runs each such op as convert, float32 op, convert).
    activation_dtype: str | None = None
    # Whether the CPU has bfloat16 dot products (AVX512-BF16 / AMX; features.has_bf16_dot).
    # No kernel here uses them yet: the development machine lacks both, so such a kernel
    # could not be tested. Recorded so that the choice can be made at run time.
    bf16_dot: bool = False

    @classmethod
    def select(
        cls,
        params: Any,
        map_matmul_weights: WeightMap,
        *,
        attention_backend: str,
        sharded: bool,
    ) -> CpuBackend:
        """The kernels for these params. The native ones run with the "cpu" attention backend
        (asked for, or the default where the kernels build: the Platform resolves it) on one device
        (sharded weights take XLA's SPMD dots). The native matmul also needs float32 or
        bfloat16 weights, or int8-quantized ones with an even K, with every output size a
        multiple of its panel width."""
        if attention_backend is None:
            raise ValueError("CpuBackend.select needs a resolved attention backend, got None")
        native = not sharded and attention_backend == "cpu"
        views = _matmul_views(params, map_matmul_weights) if native and cpu.available() else []
        kind = _linear_kind(views)
        narrow = kind == "float" and {dtype for _, _, dtype, _ in views} != {jnp.dtype(jnp.float32)}
        return cls(
            native_attention=native,
            native_linear=kind is not None,
            int8_weights=kind == "int8",
            grouped_weights=kind == "mixed",
            native_argmax=native,
            activation_dtype="float32" if narrow else None,
            bf16_dot=features.has_bf16_dot(),
        )

    @property
    def kernels(self) -> StepKernels:
        """What the jitted step calls."""
        native = linear_q8 if self.int8_weights else cpu.linear
        if self.grouped_weights:
            native = _linear_by_weight
        return StepKernels(
            linear=native if self.native_linear else None,
            argmax=cpu.argmax if self.native_argmax else argmax_xla,
            activation_dtype=self.activation_dtype,
        )

    def pack_weights(self, params: Any, map_matmul_weights: WeightMap) -> Any:
        """The params in the layout the step's kernels read: every matmul weight in panel
        layout (one copy) under the native matmul, else the params as they are."""
        if not self.native_linear:
            return params
        if self.grouped_weights:
            return map_matmul_weights(params, _pack_by_kind)
        return map_matmul_weights(params, pack_panels_q8 if self.int8_weights else cpu.pack_panels)

    def back_with_huge_pages(self, arrays: Iterable[jax.Array]) -> int:
        """Moves the weights a step streams onto 2 MiB pages; the bytes moved."""
        return huge_pages.back_with_huge_pages(arrays)

    @staticmethod
    def configure_process() -> bool:
        """The CPU's process-wide settings: malloc tuning that lets XLA reuse each step's
        scratch (host_malloc.keep_step_buffers; before JAX starts for all of it). Whether it
        applied."""
        return host_malloc.keep_step_buffers()


def _matmul_views(params: Any, map_matmul_weights: WeightMap) -> list[tuple[int, int, Any, str]]:
    """(output size, input size, dtype, kind) of every matmul weight view pack_weights would
    pack; kind is "int8" (per-output scales), "grouped" (group-wise) or "float"."""
    views: list[tuple[int, int, Any, str]] = []

    def record(w: Any) -> Any:  # [L', N, K]
        kind = "grouped" if is_grouped_weight(w) else "int8" if is_int8_weight(w) else "float"
        if kind == "float" and hasattr(w, "group_size"):
            kind = "grouped, no kernel"  # a group size linear_q4 does not take
        views.append((w.shape[-2], w.shape[-1], jnp.dtype(w.dtype), kind))
        return w

    jax.eval_shape(lambda p: map_matmul_weights(p, record), params)
    return views


def _linear_kind(views: list[tuple[int, int, Any, str]]) -> str | None:
    """Which native matmul runs every matmul of these `_matmul_views` (shapes and dtypes
    only): "float" (cpu.linear), "int8" (linear_q8, every weight int8-quantized), "mixed"
    (each weight in its kind's kernel: linear_q4 for group-wise quantized ones, linear_q8 for
    int8 ones, cpu.linear for float ones) or None (XLA's)."""
    if not views:
        return None  # the model leaves its matmuls to XLA
    fits = all(
        n % cpu.PANEL == 0 and dtype in cpu.LINEAR_DTYPES
        for n, _, dtype, kind in views
        if kind == "float"
    ) and all(n % cpu.PANEL == 0 and k % 2 == 0 for n, k, _, kind in views if kind == "int8")
    kinds = {kind for *_, kind in views}
    if not fits or not kinds <= {"grouped", "int8", "float"}:
        return None
    return kinds.pop() if kinds in ({"float"}, {"int8"}) else "mixed"


def _pack_by_kind(w: Any) -> Any:
    """A weight in its kernel's layout: float in cpu.linear's panels, int8 in linear_q8's;
    a group-wise one as it is."""
    if is_grouped_weight(w):
        return w
    return pack_panels_q8(w) if is_int8_weight(w) else cpu.pack_panels(w)


def _linear_by_weight(x: jax.Array, w: Any, layer: Any, **fused: Any) -> jax.Array:
    """cpu.linear's contract for params that mix group-wise quantized weights (linear_q4),
    int8 ones (linear_q8) and float ones in panel layout (cpu.linear): chosen per weight
    while tracing."""
    if is_grouped_weight(w):
        return linear_q4(x, w, layer, **fused)
    return (linear_q8 if is_int8_weight(w) else cpu.linear)(x, w, layer, **fused)
