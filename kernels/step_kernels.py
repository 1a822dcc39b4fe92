"""StepKernels: the matmul, logits and greedy-argmax functions of an engine's jitted step.

A platform backend (:mod:`jaxpaged.kernels.platform`) chooses them once per engine; the step
and the model code call them and never branch on the platform themselves. Frozen and hashable,
so the step takes them as a static argument and the choice is part of the compiled program.
The default is XLA's everywhere: the model's own dots and ``jnp.argmax``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["XLA_KERNELS", "StepKernels", "argmax_xla"]


def argmax_xla(x: jax.Array) -> jax.Array:  # float32 [R, V] -> int32 [R]
    """``jnp.argmax`` of each row (the first index of its maximum)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class StepKernels:
    """The kernels one engine's step runs.

    ``linear(x, w, index, *, num_rows, out_dtype=None, norm=None, silu_gate=None,
    residual=None)`` does every matmul, over weights in the layout its backend packed them
    into (rows of x from ``num_rows`` on may come out as zeros); None leaves the matmuls to the
    model's XLA dots. ``argmax`` is greedy sampling's ``[R, V] float32 -> [R] int32``.
    ``activation_dtype``: the dtype of the activations between the model's layers where the
    kernels compute in another dtype than the params' (bfloat16 weights under a float32
    matmul: the hidden states stay float32, never rounded to bfloat16 and widened again by
    every norm, rotary and residual op); None: the params' dtype.
    """

    linear: Callable[..., jax.Array] | None = None
    argmax: Callable[[jax.Array], jax.Array] = argmax_xla
    activation_dtype: str | None = None

    def model_kwargs(self, num_rows: jax.Array | int) -> dict[str, object]:
        """The keyword arguments of the model's forward for a step whose first ``num_rows``
        rows are real: its ``linear_fn`` and ``activation_dtype`` where these kernels set
        them (a model without a native matmul takes neither)."""
        linear_fn = self.linear_fn(num_rows)
        if linear_fn is None:
            return {}
        kw: dict[str, object] = {"linear_fn": linear_fn}
        if self.activation_dtype is not None:
            kw["activation_dtype"] = jnp.dtype(self.activation_dtype)
        return kw

    def linear_fn(self, num_rows: jax.Array | int) -> Callable[..., jax.Array] | None:
        """The model's ``linear_fn`` for a step whose first ``num_rows`` rows are real (a
        kernel that stops there pays nothing for the bucket's padding); None: XLA's dots."""
        if self.linear is None:
            return None
        return functools.partial(self.linear, num_rows=num_rows)

    def logits_fn(self, num_rows: jax.Array | int) -> Callable[..., jax.Array] | None:
        """The vocabulary projection's ``linear_fn`` (float32 logits) for ``num_rows`` real
        rows; None: XLA's dot, which accumulates 16-bit params in float32."""
        if self.linear is None:
            return None
        return functools.partial(self.linear, num_rows=num_rows, out_dtype=jnp.float32)


XLA_KERNELS = StepKernels()  # the default on every platform
