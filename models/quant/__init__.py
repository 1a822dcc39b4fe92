"""Weight quantization: formats kept quantized in the params tree and dequantized inside the
matmul (see weights.py), and the load-time quantization of float checkpoints (params.py)."""

from .params import QUANTIZATIONS, check_quantization, is_quantized, quantize_params, weight_bytes
from .weights import METHODS, QuantizedWeight, quantize_array

__all__ = [
    "METHODS",
    "QUANTIZATIONS",
    "QuantizedWeight",
    "check_quantization",
    "is_quantized",
    "quantize_array",
    "quantize_params",
    "weight_bytes",
]
