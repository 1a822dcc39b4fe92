"""QuantizedWeight: a matmul weight kept in fewer bits, with the scales that restore it.

Weight-only quantization with one float32 scale per output channel (symmetric, no zero
point): ``w ~= values * scales``. Decode streams every weight once per step, so the bytes per
weight bound its speed; int8 and fp8 values are a quarter of float32's.

The weight keeps the shape of the float leaf it replaces (``values``), and ``scales`` has that
shape with the contracted ("in") axes set to 1, so a leaf stacked [L, Hkv, G + 2, hd, D] or
[L, D, Hkv, G, hd] reshapes into its ``linear_fn`` view [L, N, K] and back like the float
one, and tensor parallelism splits ``values`` and ``scales`` on the same axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["METHODS", "QuantizedWeight", "quantize_array"]

# method -> (values dtype, largest magnitude a value may take)
METHODS: dict[str, tuple[Any, float]] = {
    "int8": (np.int8, 127.0),
    "fp8": (ml_dtypes.float8_e4m3fn, float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """``values * scales``, broadcast: a weight in int8 or fp8 with per-output-channel
    float32 scales (arrays of numpy or JAX alike)."""

    values: Any  # int8 or float8_e4m3fn [..., N, K] (any stacked leaf shape)
    scales: Any  # float32, values' shape with the contracted axes 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.values.dtype)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scales.nbytes)

    def __getitem__(self, index: Any) -> QuantizedWeight:
        """Indexes the leading (stacking) axes of both."""
        return QuantizedWeight(self.values[index], self.scales[index])

    def reshape(self, *shape: Any) -> QuantizedWeight:
        """The values reshaped to ``shape`` (one -1 allowed), the scales to the longest
        prefix of it that holds them, padded with 1s (the output axes lead, so this is the
        same split of output and contracted axes in the new shape)."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        values = self.values.reshape(shape)
        new = tuple(values.shape)
        size = math.prod(self.scales.shape)
        for n_out in range(len(new), -1, -1):
            if math.prod(new[:n_out]) == size:
                break
        else:  # pragma: no cover - math.prod(()) == 1 always matches a scalar scale
            raise ValueError(f"scales {self.scales.shape} do not fit the shape {new}")
        scales = self.scales.reshape(new[:n_out] + (1,) * (len(new) - n_out))
        return QuantizedWeight(values, scales)

    def dequantize(self, dtype: Any = jnp.float32) -> Any:
        """The float weight ``values * scales`` in ``dtype``."""
        xp = np if isinstance(self.values, np.ndarray) else jnp
        return (xp.asarray(self.values).astype(np.float32) * self.scales).astype(dtype)


def quantize_array(w: Any, in_axes: int, method: str) -> QuantizedWeight:
    """``w`` (float, numpy) quantized per output channel: its last ``in_axes`` axes are
    contracted by the matmul; every index of the others gets its own scale, absmax / qmax,
    so the largest weight of each output maps to the format's largest value."""
    if method not in METHODS:
        raise ValueError(f"quantization: {method!r} is not one of {', '.join(METHODS)}")
    dtype, qmax = METHODS[method]
    w = np.asarray(w, np.float32)
    axes = tuple(range(w.ndim - in_axes, w.ndim))
    absmax = np.max(np.abs(w), axis=axes, keepdims=True)
    scales = np.where(absmax > 0, absmax / qmax, 1.0).astype(np.float32)
    q = w / scales
    if method == "int8":
        values = np.clip(np.rint(q), -qmax, qmax).astype(np.int8)
    else:  # round to nearest in e4m3 (ml_dtypes' cast rounds to nearest even)
        values = np.clip(q, -qmax, qmax).astype(dtype)
    return QuantizedWeight(values, scales)
