"""Reading a pre-quantized checkpoint's linear weights straight into `QuantizedWeight`s
(never through float), and the stacked host buffers the loader fills with them.

The loader fills each stacked leaf (``wqkv`` [L, Hkv, G + 2, hd, D], ``wo`` [L, D, Hkv, G,
hd], ...) by indexing its leading axes and assigning reshaped HF tensors. `QuantizedBuffer`
takes the same indexing and assignments with a `QuantizedWeight` (values and scales written
side by side), so the loader's layout code serves float and quantized checkpoints alike.

compressed-tensors layout (vLLM's ``compressed_tensors`` scheme readers, and the
``compressed_tensors`` package's compressors): a quantized ``<module>.weight`` is stored as

- naive/float/int-quantized: ``weight`` (F8_E4M3 or I8) [N, K] and ``weight_scale`` F32 [N, 1]
  (channel) or [1] / [] (tensor);
- pack-quantized (8-bit): ``weight_packed`` I32 [N, K / 4], element k at bits 8 (k % 4) of word
  k // 4 (little-endian bit stream), stored offset by +128; ``weight_shape`` [2] the float
  shape; ``weight_scale`` as above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import ModelConfig
from .checkpoint import CheckpointQuantization
from .params import LAYER_IN_AXES
from .weights import METHODS, QuantizedWeight

__all__ = ["QuantizedBuffer", "QuantizedReader", "finish_buffers", "prequantized_reading"]

# stacked leaf -> the HF modules of one layer that fill it (the Llama family, not phi3)
_LEAF_MODULES = {
    "wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "wo": ("self_attn.o_proj",),
    "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "w_down": ("mlp.down_proj",),
}


class QuantizedReader:
    """Reads tensors by HF name like the loader's float reader, except that a quantized
    linear weight comes back as a `QuantizedWeight` (numpy) when it is in ``kept`` (its
    stacked leaf is kept quantized), and dequantized to float otherwise (MoE experts, a leaf
    that the checkpoint quantized only in part)."""

    def __init__(
        self,
        st: Any,  # loader.SafetensorsIndex
        read_float: Callable[[str, tuple[int, ...]], np.ndarray],
        quant: CheckpointQuantization,
        folder: str,
        kept: frozenset[str],  # HF weight names read as QuantizedWeight
    ):
        self.st, self.read_float, self.quant, self.folder = st, read_float, quant, folder
        self.kept = kept

    def __call__(self, name: str, shape: tuple[int, ...]) -> Any:
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or f"{module}.weight_scale" not in self.st:
            return self.read_float(name, shape)  # float in the checkpoint (ignored, a norm)
        weight = self._read(module, tuple(shape))
        if name in self.kept:
            return weight
        return weight.dequantize(np.float32).astype(self.read_float.dtype)

    def _read(self, module: str, shape: tuple[int, ...]) -> QuantizedWeight:
        n = shape[0]
        if self.quant.packed:
            values = self._unpack_int8(module, shape)
        else:
            values = self._tensor(f"{module}.weight", shape)
            want = METHODS[self.quant.method][0]
            if values.dtype != want:
                raise ValueError(
                    f"tensor {module}.weight is {values.dtype}, expected {np.dtype(want)} for "
                    f"{self.quant.format_name} {self.quant.method} (checkpoint {self.folder!r})"
                )
        scale = np.asarray(self.st.get(f"{module}.weight_scale"), np.float32)
        if scale.size == 1:  # per tensor
            scale = np.full((n, 1), scale.reshape(()), np.float32)
        elif scale.shape != (n, 1):
            raise ValueError(
                f"tensor {module}.weight_scale has shape {scale.shape}, expected ({n}, 1) or "
                f"(1,) (checkpoint {self.folder!r})"
            )
        return QuantizedWeight(np.ascontiguousarray(values), scale)

    def _tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.st:
            raise ValueError(f"missing tensor {name!r} in checkpoint {self.folder!r}")
        got = self.st.shape(name)
        if got != shape:
            raise ValueError(
                f"tensor {name!r} has shape {got}, expected {shape} for this config "
                f"(checkpoint {self.folder!r})"
            )
        return self.st.get(name)

    def _unpack_int8(self, module: str, shape: tuple[int, ...]) -> np.ndarray:
        n, k = shape
        stored = tuple(int(s) for s in np.asarray(self.st.get(f"{module}.weight_shape")))
        if stored != shape:
            raise ValueError(
                f"tensor {module}.weight_shape says {stored}, expected {shape} for this config "
                f"(checkpoint {self.folder!r})"
            )
        packed = self._tensor(f"{module}.weight_packed", (n, -(-k // 4)))
        # four 8-bit fields per little-endian int32 word: its bytes in order, offset by 128
        as_bytes = np.ascontiguousarray(packed).astype("<i4").view(np.uint8)[:, :k]
        return (as_bytes.astype(np.int16) - 128).astype(np.int8)


class QuantizedBuffer:
    """A stacked leaf being filled: values of the leaf's full shape and scales with its
    contracted (last ``in_axes``) axes set to 1. Indexing the leading axes gives a view;
    assigning a `QuantizedWeight` writes both arrays."""

    def __init__(self, values: np.ndarray, scales: np.ndarray, in_axes: int, method: str):
        self.values, self.scales, self.in_axes, self.method = values, scales, in_axes, method

    @classmethod
    def empty(cls, shape: tuple[int, ...], in_axes: int, method: str) -> QuantizedBuffer:
        scales_shape = shape[: len(shape) - in_axes] + (1,) * in_axes
        return cls(
            np.empty(shape, METHODS[method][0]),
            np.empty(scales_shape, np.float32),
            in_axes,
            method,
        )

    def __getitem__(self, index: Any) -> QuantizedBuffer:
        return QuantizedBuffer(self.values[index], self.scales[index], self.in_axes, self.method)

    def __setitem__(self, index: Any, weight: Any) -> None:
        if weight.dtype != self.values.dtype:
            raise ValueError(
                f"a {weight.dtype} weight cannot join a stacked {self.values.dtype} leaf "
                "(the checkpoint mixes formats)"
            )
        self.values[index] = weight.values
        self.scales[index] = weight.scales

    def finish(self) -> QuantizedWeight:
        return QuantizedWeight(self.values, self.scales)


def prequantized_reading(
    st: Any,  # loader.SafetensorsIndex
    read_float: Callable[[str, tuple[int, ...]], np.ndarray],
    quant: CheckpointQuantization,
    config: ModelConfig,
    folder: str,
    dtype: np.dtype,
) -> tuple[QuantizedReader, dict[str, Any]]:
    """(reader, empty stacked layers) for the loader's layer filling: the matmul leaves
    whose modules the checkpoint quantized in every layer as `QuantizedBuffer`s in its
    method, the rest float (a leaf quantized only in part is dequantized, so that it is the
    checkpoint's weights exactly; vLLM too runs a checkpoint's ignored modules in float)."""
    if config.model_type == "phi3":  # its fused qkv and gate_up rows are split as floats
        raise ValueError(
            f"checkpoint {folder!r}: pre-quantized {config.model_type} checkpoints are not "
            "read yet (load the float checkpoint with quantization='int8' or 'fp8')"
        )
    from ..llama import param_shapes

    kept = {"lm_head.weight"} if "lm_head.weight_scale" in st else set()
    layers: dict[str, Any] = {}
    for name, shape in param_shapes(config)["layers"].items():
        weights = [
            f"model.layers.{i}.{module}.weight"
            for i in range(config.num_layers)
            for module in _LEAF_MODULES.get(name, ())
        ]
        if weights and all(w.removesuffix("weight") + "weight_scale" in st for w in weights):
            layers[name] = QuantizedBuffer.empty(shape, LAYER_IN_AXES[name], quant.method)
            kept.update(weights)
        else:
            layers[name] = np.empty(shape, dtype)
    return QuantizedReader(st, read_float, quant, folder, frozenset(kept)), layers


def finish_buffers(layers: dict[str, Any]) -> dict[str, Any]:
    """The filled buffers as params leaves (`QuantizedWeight`s and float arrays)."""
    return {k: v.finish() if isinstance(v, QuantizedBuffer) else v for k, v in layers.items()}
