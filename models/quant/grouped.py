"""GroupedWeight: a matmul weight quantized in groups of G consecutive inputs (4 or 8 bits).

One format for the group-wise checkpoints: GGUF's Q4_0, Q4_1, Q4_K, Q8_0 and Q6_K, and AWQ
and GPTQ. Every group of G inputs k of one output n has its own float32 ``scale`` and (4-bit)
``min``, and the weight is

    w[..., n, k] = q[..., n, k] * scales[..., n, k // G] + mins[..., n, k // G]

Layout (arrays of numpy or JAX alike; the contracted axis K is always the last one):

- 4-bit: ``values`` uint8 [..., N, K // 2], two unsigned 4-bit q (0..15) per byte, the LOW
  nibble holding the even k and the high nibble the odd k (``values[n, j] = q[n, 2j] |
  q[n, 2j + 1] << 4``); ``scales`` and ``mins`` float32 [..., N, K // G].
- 8-bit: ``values`` int8 [..., N, K] (signed q), ``scales`` float32 [..., N, K // G],
  ``mins`` None (w = q * scale).

How the formats map onto it (exactly, in float32):

- Q4_0: q = the stored nibble, scale = d, min = -8 * d.
- Q4_1: q * d + m.
- Q4_K: per 32-input sub-block, scale = d * sc, min = -(dmin * m).
- AWQ / GPTQ: (q - z) * s = q * s + (-z * s).
- Q8_0: 8-bit, scale = d. Q6_K: 8-bit with q - 32 stored, scale = d * sc per 16 inputs.

Act-order (GPTQ's desc_act): ``g_idx`` int32 [..., K], the group of each input, whose
leading axes are the values' or 1 (one row per layer, shared by every output), makes the groups
arbitrary sets of inputs: w[..., n, k] = q[..., n, k] * scales[..., n, g_idx[k]] + mins[...,
n, g_idx[k]]. None (every other format): g_idx[k] = k // G.

``shape`` (static, with the group size and the bit width: the pytree's aux data) is the shape
of the float leaf the weight replaces, e.g. wqkv's [L, Hkv, G + 2, hd, D] or wo's
[L, D, Hkv, G, hd], whose trailing axes multiply to K. So `reshape` to the ``linear_fn`` view
[L, N, K] and back, and tensor-parallel shardings keyed on the float shape, work as for a
float leaf; the arrays themselves always keep K flat in their last axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GroupedWeight",
    "grouped_sharding_tree",
    "grouped_shardings",
    "pack_nibbles",
    "quantize_grouped",
    "unpack_nibbles",
]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class GroupedWeight:
    """A group-wise quantized weight (see the module docstring for the layout)."""

    values: Any  # 4-bit: uint8 [..., N, K // 2]; 8-bit: int8 [..., N, K]
    scales: Any  # float32 [..., N, K // G]
    mins: Any  # 4-bit: float32 [..., N, K // G]; 8-bit: None
    shape: tuple[int, ...]  # the float weight's shape, trailing axes multiplying to K
    group_size: int  # G: consecutive inputs sharing a scale (and min)
    bits: int  # 4 or 8
    g_idx: Any = None  # act-order: int32 [..., K], leading axes the values' or 1; else None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"GroupedWeight: bits must be 4 or 8, got {self.bits}")
        prefix = tuple(self.values.shape[:-1])
        k = self.values.shape[-1] * (2 if self.bits == 4 else 1)
        g = self.group_size
        if g <= 0 or k % g or (self.bits == 4 and g % 2):
            raise ValueError(f"GroupedWeight: K = {k} is not a multiple of group size {g}")
        if tuple(self.scales.shape) != (*prefix, k // g):
            raise ValueError(
                f"GroupedWeight: scales {tuple(self.scales.shape)}, expected {(*prefix, k // g)}"
            )
        if (self.mins is None) != (self.bits == 8):
            raise ValueError("GroupedWeight: 4-bit weights need mins, 8-bit ones take none")
        if self.mins is not None and tuple(self.mins.shape) != tuple(self.scales.shape):
            raise ValueError(f"GroupedWeight: mins {tuple(self.mins.shape)} != scales' shape")
        if self.g_idx is not None and (
            len(self.g_idx.shape) != len(prefix) + 1
            or self.g_idx.shape[-1] != k
            or any(a not in (1, b) for a, b in zip(self.g_idx.shape[:-1], prefix, strict=True))
        ):
            raise ValueError(
                f"GroupedWeight: g_idx {tuple(self.g_idx.shape)} does not broadcast over values "
                f"{tuple(self.values.shape)} with its last axis K = {k}"
            )
        if math.prod(self.shape) != math.prod(prefix) * k or _k_axes(self.shape, k) is None:
            raise ValueError(
                f"GroupedWeight: shape {self.shape} does not end in axes of K = {k} "
                f"over values {tuple(self.values.shape)}"
            )

    # pytree: the arrays are children, the shape and format static
    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        children = (self.values, self.scales, self.mins, self.g_idx)
        return children, (self.shape, self.group_size, self.bits)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> GroupedWeight:
        obj = object.__new__(cls)  # no checks: transforms pass placeholders as children
        for name, value in zip(("values", "scales", "mins", "g_idx"), children, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(("shape", "group_size", "bits"), aux, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    @property
    def in_features(self) -> int:
        """K, the contracted size."""
        return self.values.shape[-1] * (2 if self.bits == 4 else 1)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the stored values (uint8 packed nibbles, or int8)."""
        return np.dtype(self.values.dtype)

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.mins, self.g_idx) if a is not None)
        return int(self.values.nbytes + self.scales.nbytes + extra)

    def _with(
        self, values: Any, scales: Any, mins: Any, shape: tuple[int, ...], g_idx: Any = None
    ) -> GroupedWeight:
        return GroupedWeight(values, scales, mins, tuple(shape), self.group_size, self.bits, g_idx)

    def __getitem__(self, index: Any) -> GroupedWeight:
        """Indexes leading (stacking) axes, never the contracted ones: an int, a traced
        int32 scalar, or a tuple of them; ``None`` adds a leading axis of 1."""
        g_idx = self.g_idx
        if index is None:
            mins = None if self.mins is None else self.mins[None]
            g_idx = None if g_idx is None else g_idx[None]
            return self._with(self.values[None], self.scales[None], mins, (1, *self.shape), g_idx)
        index = index if isinstance(index, tuple) else (index,)
        lead = len(self.values.shape) - 1
        if len(index) > lead - 1 or any(isinstance(i, slice | type(None)) for i in index):
            raise ValueError(f"GroupedWeight indexes only its leading axes, got {index}")
        mins = None if self.mins is None else self.mins[index]
        if g_idx is not None:  # an axis g_idx broadcasts over takes index 0
            g_idx = g_idx[
                tuple(
                    0 if n == 1 else i
                    for i, n in zip(index, g_idx.shape[: len(index)], strict=True)
                )
            ]
        shape = self.shape[len(index) :]
        return self._with(self.values[index], self.scales[index], mins, shape, g_idx)

    def reshape(self, *shape: Any) -> GroupedWeight:
        """The float shape reshaped to ``shape`` (one -1 allowed), which must keep K as
        its trailing axes; the arrays' leading axes follow."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        new = _resolve(tuple(int(s) for s in shape), math.prod(self.shape))
        k = self.in_features
        k_axes = _k_axes(new, k)
        if k_axes is None:
            raise ValueError(f"GroupedWeight {self.shape}: shape {new} has no trailing K = {k}")
        prefix = new[: len(new) - k_axes]
        mins = None if self.mins is None else self.mins.reshape(*prefix, -1)
        if self.g_idx is not None:
            g_idx = _reshape_broadcast(self.g_idx, tuple(self.values.shape[:-1]), prefix)
        else:
            g_idx = None
        return self._with(
            self.values.reshape(*prefix, -1), self.scales.reshape(*prefix, -1), mins, new, g_idx
        )

    def q(self) -> Any:
        """The quantized integers [..., N, K]: 0..15 (4-bit) or the signed int8 values."""
        return unpack_nibbles(self.values) if self.bits == 4 else self.values

    def dequantize(self, dtype: Any = jnp.float32) -> Any:
        """The float weight in its own ``shape``: q * scale + min in float32 (in that order,
        multiply then add, as llama.cpp's and gguf's dequantization), then cast. Over numpy
        arrays this is the reference, bit for bit; under XLA the multiply and add may fuse
        into an FMA (one rounding), which is exact anyway where q * scale is (GGUF's scales
        have at most 17 significant bits)."""
        xp = np if isinstance(self.values, np.ndarray) else jnp
        g = self.group_size
        q = xp.asarray(self.q()).astype(np.float32)
        if self.g_idx is not None:  # act-order: each input's own group's scale and min
            g_idx = xp.broadcast_to(xp.asarray(self.g_idx), q.shape)
            w = q * xp.take_along_axis(xp.asarray(self.scales), g_idx, axis=-1)
            if self.mins is not None:
                w = w + xp.take_along_axis(xp.asarray(self.mins), g_idx, axis=-1)
            return w.reshape(self.shape).astype(dtype)
        grouped = q.reshape(*q.shape[:-1], -1, g)
        w = grouped * xp.asarray(self.scales)[..., None]
        if self.mins is not None:
            w = w + xp.asarray(self.mins)[..., None]
        return w.reshape(self.shape).astype(dtype)


def _resolve(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: at most one -1, got {shape}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(size // known if s == -1 else s for s in shape)
    if math.prod(shape) != size:
        raise ValueError(f"cannot reshape {size} elements to {shape}")
    return shape


def _reshape_broadcast(g_idx: Any, old: tuple[int, ...], new: tuple[int, ...]) -> Any:
    """``g_idx`` [*g, K] (each of g one of ``old``'s leading sizes or 1) for values whose
    leading axes go from ``old`` to ``new``: the fewest leading axes that hold its own sizes
    and span whole leading axes of ``new`` are broadcast (e.g. [L, 1, 1, K] over [L, 2, F]
    becomes [2L, 1, K] for the view [2L, F]), the rest stay 1."""
    xp = np if isinstance(g_idx, np.ndarray) else jnp
    g, k = tuple(g_idx.shape[:-1]), g_idx.shape[-1]
    first = max((i + 1 for i, n in enumerate(g) if n != 1), default=0)
    for m in range(first, len(old) + 1):
        size = math.prod(old[:m])
        for n in range(len(new) + 1):
            if math.prod(new[:n]) == size:
                whole = xp.broadcast_to(g_idx, (*old[:m], *g[m:], k))
                return whole.reshape(*new[:n], *(1,) * (len(new) - n), k)
    raise ValueError(f"g_idx {tuple(g_idx.shape)} does not fit leading axes {new}")


def _k_axes(shape: tuple[int, ...], k: int) -> int | None:
    """How many trailing axes of ``shape`` multiply to ``k`` (the fewest), or None."""
    size = 1
    for n in range(1, len(shape) + 1):
        size *= shape[-n]
        if size == k:
            return n
        if size > k:
            return None
    return None


def pack_nibbles(q: Any) -> Any:  # uint8 [..., K] (0..15) -> uint8 [..., K // 2]
    """Two 4-bit values per byte: the even k in the low nibble, the odd k in the high."""
    xp = np if isinstance(q, np.ndarray) else jnp
    q = xp.asarray(q).astype(np.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(values: Any) -> Any:  # uint8 [..., K // 2] -> uint8 [..., K]
    """The inverse of `pack_nibbles`."""
    xp = np if isinstance(values, np.ndarray) else jnp
    values = xp.asarray(values)
    pairs = xp.stack([values & 0x0F, values >> 4], axis=-1)
    return pairs.reshape(*values.shape[:-1], -1)


def quantize_grouped(w: Any, in_axes: int, group_size: int, bits: int) -> GroupedWeight:
    """``w`` (float, numpy) quantized in groups of ``group_size`` along its last
    ``in_axes`` axes (flattened to K): 4-bit asymmetric (min-max per group, q = round((w -
    min) / scale), as AWQ and Q4_1) or 8-bit symmetric (absmax / 127, as Q8_0). For load-time
    quantization and tests; checkpoints already in a grouped format are read, not requantized."""
    w = np.asarray(w, np.float32)
    shape = w.shape
    prefix = shape[: w.ndim - in_axes]
    flat = w.reshape(*prefix, -1)
    k = flat.shape[-1]
    if k % group_size or (bits == 4 and group_size % 2):
        raise ValueError(f"quantize_grouped: K = {k} is not a multiple of group {group_size}")
    groups = flat.reshape(*prefix, k // group_size, group_size)
    if bits == 4:
        lo, hi = groups.min(axis=-1), groups.max(axis=-1)
        scales = np.where(hi > lo, (hi - lo) / 15, 1.0).astype(np.float32)
        q = np.clip(np.rint((groups - lo[..., None]) / scales[..., None]), 0, 15)
        values = pack_nibbles(q.astype(np.uint8).reshape(*prefix, k))
        return GroupedWeight(values, scales, lo.astype(np.float32), shape, group_size, 4)
    if bits == 8:
        absmax = np.abs(groups).max(axis=-1)
        scales = np.where(absmax > 0, absmax / 127, 1.0).astype(np.float32)
        q = np.clip(np.rint(groups / scales[..., None]), -127, 127).astype(np.int8)
        return GroupedWeight(q.reshape(*prefix, k), scales, None, shape, group_size, 8)
    raise ValueError(f"quantize_grouped: bits must be 4 or 8, got {bits}")


def grouped_shardings(sharding: Any, weight: GroupedWeight, name: str = "") -> tuple[Any, Any]:
    """(values' sharding, scales' and mins' sharding) of ``weight`` from the sharding of
    its float leaf (a NamedSharding over ``weight.shape``; anything else is used as is).

    Output axes split as in the float leaf. A split of the contracted axes must be a split
    of K into contiguous pieces (only the outermost contracted axis of size > 1 may be
    split) that hold whole groups; anything else is refused with ValueError, since the
    pieces' scales would not line up with their values. ``name`` (the params leaf, e.g.
    "layers/w_down") goes into the error."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding, sharding
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    k = weight.in_features
    n_k = _k_axes(weight.shape, k)
    lead, contracted = spec[: weight.ndim - n_k], spec[weight.ndim - n_k :]
    dims = weight.shape[weight.ndim - n_k :]
    split = [(i, a) for i, a in enumerate(contracted) if a is not None]
    k_axis = None
    if split:
        (i, k_axis), *rest = split
        outer = [d for d in dims[:i] if d != 1]
        if rest or outer:
            raise ValueError(
                f"grouped weight {name} {weight.shape}: the sharding {sharding.spec} splits K "
                "into pieces that are not contiguous"
            )
        names = k_axis if isinstance(k_axis, tuple) else (k_axis,)
        parts = math.prod(sharding.mesh.shape[a] for a in names)
        # act-order: a piece's inputs belong to any groups, so every device holds all the
        # scales and mins (pieces need only whole bytes of 4-bit values)
        unit = weight.bits // 4 if weight.g_idx is not None else weight.group_size
        if k % parts or (k // parts) % unit:
            raise ValueError(
                f"grouped weight {name} {weight.shape}: tensor parallelism splits its "
                f"{k} inputs into {parts} pieces of {k / parts:g}, which cut its groups of "
                f"{weight.group_size} inputs (each piece must hold whole groups; use a "
                "tensor_parallel_size that does, or a float or per-channel quantization)"
            )
    values = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*lead, k_axis))
    group_k = None if weight.g_idx is not None else k_axis
    groups = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*lead, group_k))
    return values, groups


def grouped_sharding_tree(sharding: Any, weight: GroupedWeight, name: str = "") -> GroupedWeight:
    """`grouped_shardings` as a tree of ``weight``'s structure (values', scales' and, 4-bit,
    mins' shardings in its fields), for ``jax.device_put(weight, tree)``."""
    values, groups = grouped_shardings(sharding, weight, name)
    mins = None if weight.mins is None else groups
    g_idx = None
    if weight.g_idx is not None and isinstance(values, jax.sharding.NamedSharding):
        spec = tuple(values.spec) + (None,) * (len(weight.values.shape) - len(values.spec))
        kept = [
            a if n != 1 else None for a, n in zip(spec[:-1], weight.g_idx.shape[:-1], strict=True)
        ]
        pspec = jax.sharding.PartitionSpec(*kept, spec[-1])  # K split as the values'
        g_idx = jax.sharding.NamedSharding(values.mesh, pspec)
    elif weight.g_idx is not None:
        g_idx = values
    return GroupedWeight.tree_unflatten(
        (weight.shape, weight.group_size, weight.bits), (values, groups, mins, g_idx)
    )
