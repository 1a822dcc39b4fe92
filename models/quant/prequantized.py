"""Reading a pre-quantized checkpoint's linear weights as stored (never through float): into
`QuantizedWeight` (compressed-tensors int8 / fp8 per channel or tensor) or `GroupedWeight`
(compressed-tensors W8A16 / W4A16 groups, AWQ, GPTQ), and the stacked host buffers the loader
fills with them.

The loader fills each stacked leaf (``wqkv`` [L, Hkv, G + 2, hd, D], ``wo`` [L, D, Hkv, G,
hd], ...) by indexing its leading axes and assigning reshaped HF tensors. `StackedBuffer`
takes the same indexing and assignments with a quantized weight (its arrays written side by
side), so the loader's layout code serves float and quantized checkpoints alike.

compressed-tensors layout (vLLM's ``compressed_tensors`` scheme readers, and the
``compressed_tensors`` package's compressors): a quantized ``<module>.weight`` is stored as

- naive/float/int-quantized: ``weight`` (F8_E4M3 or I8) [N, K] and ``weight_scale`` F32 [N, 1]
  (channel) or [1] / [] (tensor);
- pack-quantized (8-bit): ``weight_packed`` I32 [N, K / 4], element k at bits 8 (k % 4) of word
  k // 4 (little-endian bit stream), stored offset by +128; ``weight_shape`` [2] the float
  shape; ``weight_scale`` as above.

AWQ and GPTQ: ``qweight``, ``qzeros``, ``scales`` (and GPTQ's ``g_idx``), gptq_awq.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..registry import family_of
from .checkpoint import CheckpointQuantization
from .gptq_awq import awq_weight, gptq_weight, unpack_int4_words
from .grouped import GroupedWeight, pack_nibbles
from .weights import METHODS, QuantizedWeight

__all__ = [
    "QuantizedReader",
    "StackedBuffer",
    "check_prequantized",
    "finish_buffers",
    "prequantized_reading",
]


def check_prequantized(config: ModelConfig, quant: CheckpointQuantization, folder: str) -> None:
    """ValueError, before any weight is read, for a model whose family declares that its
    pre-quantized checkpoints are not read."""
    reason = family_of(config).refusal("prequantized", config)
    if reason is not None:
        raise ValueError(
            f"checkpoint {folder!r}: pre-quantized ({quant.format_name}) {config.model_type} "
            f"checkpoints are not read: {reason}"
        )


class QuantizedReader:
    """Reads tensors by HF name like the loader's float reader, except that a quantized
    linear weight comes back quantized (numpy arrays) when it is in ``kept`` (its stacked
    leaf is kept quantized), and dequantized to float otherwise (MoE experts, a leaf that the
    checkpoint quantized only in part)."""

    def __init__(
        self,
        st: Any,  # loader.SafetensorsIndex
        read_float: Callable[[str, tuple[int, ...]], np.ndarray],
        quant: CheckpointQuantization,
        folder: str,
        kept: frozenset[str],  # HF weight names read as quantized weights
    ):
        self.st, self.read_float, self.quant, self.folder = st, read_float, quant, folder
        self.kept = kept

    def __call__(self, name: str, shape: tuple[int, ...]) -> Any:
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or f"{module}.{self.quant.marker}" not in self.st:
            return self.read_float(name, shape)  # float in the checkpoint (ignored, a norm)
        n, k = shape
        bar = getattr(self.read_float, "bar", None)  # the loader's progress bar
        if bar is not None:
            bar.update(1)
        if self.quant.grouped_bits:
            weight = self._grouped(module, n, k)
        else:
            weight = self._per_channel(module, n, k)
        if name in self.kept:
            return weight
        return weight.dequantize(np.float32).astype(self.read_float.dtype)

    def _tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in self.st:
            raise ValueError(f"missing tensor {name!r} in checkpoint {self.folder!r}")
        got = self.st.shape(name)
        if shape is not None and got != shape:
            raise ValueError(
                f"tensor {name!r} has shape {got}, expected {shape} for this config "
                f"(checkpoint {self.folder!r})"
            )
        return np.asarray(self.st.get(name))

    def _per_channel(self, module: str, n: int, k: int) -> QuantizedWeight:
        if self.quant.packed:
            values = self._unpack_int8(module, n, k)
        else:
            values = self._tensor(f"{module}.weight", (n, k))
            want = METHODS[self.quant.method][0]
            if values.dtype != want:
                raise ValueError(
                    f"tensor {module}.weight is {values.dtype}, expected {np.dtype(want)} for "
                    f"{self.quant.format_name} {self.quant.method} (checkpoint {self.folder!r})"
                )
        scale = self._tensor(f"{module}.weight_scale").astype(np.float32)
        if scale.size == 1:  # per tensor
            scale = np.full((n, 1), scale.reshape(()), np.float32)
        elif scale.shape != (n, 1):
            raise ValueError(
                f"tensor {module}.weight_scale has shape {scale.shape}, expected ({n}, 1) or "
                f"(1,) (checkpoint {self.folder!r})"
            )
        return QuantizedWeight(np.ascontiguousarray(values), scale)

    def _check_weight_shape(self, module: str, n: int, k: int) -> None:
        stored = tuple(int(s) for s in self._tensor(f"{module}.weight_shape"))
        if stored != (n, k):
            raise ValueError(
                f"tensor {module}.weight_shape says {stored}, expected {(n, k)} for this "
                f"config (checkpoint {self.folder!r})"
            )

    def _unpack_int8(self, module: str, n: int, k: int) -> np.ndarray:
        self._check_weight_shape(module, n, k)
        packed = self._tensor(f"{module}.weight_packed", (n, -(-k // 4)))
        # four 8-bit fields per little-endian int32 word: its bytes in order, offset by 128
        as_bytes = np.ascontiguousarray(packed).astype("<i4").view(np.uint8)[:, :k]
        return (as_bytes.astype(np.int16) - 128).astype(np.int8)

    def _grouped(self, module: str, n: int, k: int) -> GroupedWeight:
        q = self.quant
        g = k if q.group_size == -1 else q.group_size
        if k % g or k % 8 or n % 8:
            raise ValueError(
                f"{module}: {n} outputs x {k} inputs do not split into {q.format_name} groups "
                f"of {g} and words of 8 (checkpoint {self.folder!r})"
            )
        if q.grouped_bits == 8:
            return self._ct_int8_groups(module, n, k, g)
        if q.quant_method == "compressed-tensors":
            return self._ct_int4(module, n, k, g)
        groups = (k // g, n)
        scales = self._tensor(f"{module}.scales", groups)
        if q.quant_method == "awq":
            qweight = self._tensor(f"{module}.qweight", (k, n // 8))
            qzeros = self._tensor(f"{module}.qzeros", (k // g, n // 8))
            return awq_weight(qweight, qzeros, scales, g)
        qweight = self._tensor(f"{module}.qweight", (k // 8, n))
        qzeros = self._tensor(f"{module}.qzeros", (k // g, n // 8))
        g_idx = self._tensor(f"{module}.g_idx", (k,)) if f"{module}.g_idx" in self.st else None
        try:
            return gptq_weight(qweight, qzeros, scales, g_idx, g, zero_offset=q.zero_offset)
        except ValueError as e:
            raise ValueError(f"{module} (checkpoint {self.folder!r}): {e}") from None

    def _ct_int8_groups(self, module: str, n: int, k: int, g: int) -> GroupedWeight:
        """compressed-tensors int8 in groups (W8A16): the values as per channel, plain or
        packed, and ``weight_scale`` [N, K / G]; w = q * s."""
        if self.quant.packed:
            values = self._unpack_int8(module, n, k)
        else:
            values = self._tensor(f"{module}.weight", (n, k))
        if values.dtype != np.int8:
            raise ValueError(f"tensor {module}.weight is {values.dtype}, expected int8")
        scales = self._tensor(f"{module}.weight_scale", (n, k // g)).astype(np.float32)
        return GroupedWeight(np.ascontiguousarray(values), scales, None, (n, k), g, 8)

    def _ct_int4(self, module: str, n: int, k: int, g: int) -> GroupedWeight:
        """compressed-tensors W4A16: ``weight_packed`` int32 [N, K / 8], eight 4-bit fields per
        word in bit order, each stored as q + 8 (q signed); ``weight_scale`` [N, K / G]; with
        zero points, ``weight_zero_point`` int32 [N / 8, K / G] packed the same way along N.
        w = (q - zp) * s = u * s - (zp + 8) * s for the stored u = q + 8."""
        self._check_weight_shape(module, n, k)
        u = unpack_int4_words(self._tensor(f"{module}.weight_packed", (n, k // 8)))
        scales = self._tensor(f"{module}.weight_scale", (n, k // g)).astype(np.float32)
        if self.quant.symmetric:
            zero_stored = np.full(scales.shape, 8.0, np.float32)
        else:
            zp = self._tensor(f"{module}.weight_zero_point", (n // 8, k // g))
            zero_stored = unpack_int4_words(np.ascontiguousarray(zp.T)).T.astype(np.float32)
        return GroupedWeight(pack_nibbles(u), scales, -zero_stored * scales, (n, k), g, 4)


class StackedBuffer:
    """A stacked quantized leaf being filled: the arrays of its quantized weight, each with
    the leaf's leading (output) axes. Indexing those gives a view; assigning a quantized
    weight of the same kind writes all its arrays."""

    def __init__(
        self, arrays: tuple[np.ndarray, ...], shape: tuple[int, ...], quant, in_axes, g_idx=None
    ):
        self.arrays, self.shape, self.quant, self.in_axes = arrays, shape, quant, in_axes
        # act-order: int32 [L, 1, ..., 1, K], each layer's g_idx (-1 until written)
        self.g_idx = g_idx

    @classmethod
    def empty(cls, shape: tuple[int, ...], in_axes: int, quant: CheckpointQuantization):
        lead = shape[: len(shape) - in_axes]
        k = math.prod(shape[len(lead) :])
        g = k if quant.group_size == -1 else quant.group_size
        if quant.grouped_bits == 4:  # values, scales, mins
            arrays = (
                np.empty((*lead, k // 2), np.uint8),
                np.empty((*lead, k // g), np.float32),
                np.empty((*lead, k // g), np.float32),
            )
        elif quant.grouped_bits == 8:  # values, scales
            arrays = (np.empty((*lead, k), np.int8), np.empty((*lead, k // g), np.float32))
        else:
            arrays = (
                np.empty(shape, METHODS[quant.method][0]),
                np.empty((*lead, *(1,) * in_axes), np.float32),
            )
        g_idx = None
        if quant.act_order and quant.grouped_bits:
            g_idx = np.full((lead[0], *(1,) * (len(lead) - 1), k), -1, np.int32)
        return cls(arrays, shape, quant, in_axes, g_idx)

    def __getitem__(self, index: Any) -> StackedBuffer:
        arrays = tuple(a[index] for a in self.arrays)  # a view: finish() is the whole leaf's
        g_idx = None if self.g_idx is None else self.g_idx[self._g_idx_index(index)]
        return StackedBuffer(arrays, (), self.quant, self.in_axes, g_idx)

    def _g_idx_index(self, index: Any) -> tuple[Any, ...]:
        """``index`` into the values' leading axes, for g_idx, whose axes of size 1 are
        shared by every index there."""
        index = index if isinstance(index, tuple) else (index,)
        return tuple(
            (0 if isinstance(i, int | np.integer) else slice(None)) if n == 1 else i
            for i, n in zip(index, self.g_idx.shape[: len(index)], strict=True)
        )

    def __setitem__(self, index: Any, weight: Any) -> None:
        if isinstance(weight, GroupedWeight):
            parts = tuple(a for a in (weight.values, weight.scales, weight.mins) if a is not None)
        elif isinstance(weight, QuantizedWeight):
            parts = (weight.values, weight.scales)
        else:
            parts = ()
        if len(parts) != len(self.arrays) or parts[0].dtype != self.arrays[0].dtype:
            raise ValueError(
                f"a {type(weight).__name__} cannot join a stacked {self.quant.method} leaf "
                "(the checkpoint mixes formats)"
            )
        if getattr(weight, "g_idx", None) is not None and self.g_idx is None:
            raise ValueError(
                "GPTQ: a g_idx is not k // group_size (act-order) while the checkpoint's "
                "quantization_config has desc_act false"
            )
        for array, part in zip(self.arrays, parts, strict=True):
            array[index] = part
        if self.g_idx is not None:
            self._set_g_idx(index, weight)

    def _set_g_idx(self, index: Any, weight: GroupedWeight) -> None:
        """Record the layer's g_idx; every part of a fused leaf (q, k and v; gate and up)
        shares its input, so they must share the order their inputs were quantized in."""
        target = self.g_idx[self._g_idx_index(index)]
        k = target.shape[-1]
        own = np.arange(k, dtype=np.int32) // weight.group_size
        new = np.broadcast_to(own if weight.g_idx is None else weight.g_idx, target.shape)
        if ((target >= 0) & (target != new)).any():
            raise ValueError(
                "GPTQ act-order: the projections fused into one weight (q, k and v, or gate "
                "and up) have different g_idx; jaxpaged needs them equal"
            )
        target[...] = new

    def finish(self) -> QuantizedWeight | GroupedWeight:
        bits = self.quant.grouped_bits
        if bits:
            k = math.prod(self.shape[len(self.shape) - self.in_axes :])
            g = k if self.quant.group_size == -1 else self.quant.group_size
            mins = self.arrays[2] if bits == 4 else None
            g_idx = self.g_idx
            if g_idx is not None and (g_idx < 0).any():  # pragma: no cover - the loader fills all
                raise ValueError("GPTQ act-order: a layer's g_idx was not read")
            return GroupedWeight(self.arrays[0], self.arrays[1], mins, self.shape, g, bits, g_idx)
        return QuantizedWeight(*self.arrays)


def prequantized_reading(
    st: Any,  # loader.SafetensorsIndex
    read_float: Callable[[str, tuple[int, ...]], np.ndarray],
    quant: CheckpointQuantization,
    config: ModelConfig,
    folder: str,
    dtype: np.dtype,
) -> tuple[QuantizedReader, dict[str, Any]]:
    """(reader, empty stacked layers) for the loader's layer filling: the matmul leaves
    whose modules the checkpoint quantized in every layer as `StackedBuffer`s, the rest
    float (a leaf quantized only in part is dequantized, so that it is the checkpoint's
    weights exactly; vLLM too runs a checkpoint's ignored modules in float)."""
    check_prequantized(config, quant, folder)
    marker = "." + quant.marker
    kept = {"lm_head.weight"} if "lm_head" + marker in st else set()
    layers: dict[str, Any] = {}
    family = family_of(config)
    for name, shape in family.param_shapes(config)["layers"].items():
        modules = [
            f"model.layers.{i}.{module}"
            for i in range(config.num_layers)
            for module in family.prequantized_modules.get(name, ())
        ]
        if modules and all(m + marker in st for m in modules):
            layers[name] = StackedBuffer.empty(shape, family.matmul_weights[name], quant)
            kept.update(m + ".weight" for m in modules)
        else:
            layers[name] = np.empty(shape, dtype)
    return QuantizedReader(st, read_float, quant, folder, frozenset(kept)), layers


def finish_buffers(layers: dict[str, Any]) -> dict[str, Any]:
    """The filled buffers as params leaves (quantized weights and float arrays)."""
    return {k: v.finish() if isinstance(v, StackedBuffer) else v for k, v in layers.items()}
