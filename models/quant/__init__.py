"""Weight quantization: formats kept quantized in the params tree and dequantized inside the
matmul (per output channel: weights.py; in groups of inputs, 4 or 8 bits: grouped.py), and the
load-time quantization of float checkpoints (params.py)."""

from .grouped import GroupedWeight, quantize_grouped
from .params import QUANTIZATIONS, check_quantization, is_quantized, quantize_params, weight_bytes
from .weights import METHODS, QuantizedWeight, quantize_array

__all__ = [
    "METHODS",
    "GroupedWeight",
    "QUANTIZATIONS",
    "QuantizedWeight",
    "check_quantization",
    "is_quantized",
    "quantize_array",
    "quantize_grouped",
    "quantize_params",
    "weight_bytes",
]
