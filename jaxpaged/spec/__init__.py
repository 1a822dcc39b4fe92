"""Speculative decoding, host side: the configuration (vLLM's ``speculative_config`` keys).
Plain Python, no JAX."""

from jaxpaged.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
