"""Paged-attention kernels over the KV block pool (see DESIGN.md, "The kernel interface")."""

from .attention import BACKENDS, default_backend, ragged_paged_attention, validate_inputs
from .reference import ragged_paged_attention_reference
from .write_kv import write_kv

__all__ = [
    "BACKENDS",
    "default_backend",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "validate_inputs",
    "write_kv",
]
