"""Paged-attention kernels over the KV block pool (docs/architecture.md, "The kernel interface").

`ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
*, sm_scale, sliding_window=None, soft_cap=None, backend=None, interpret=None,
max_q_len=None, max_kv_len=None, alibi_slopes=None, causal_limits=None)` and
`write_kv(k_pages, v_pages, k, v, slot_mapping)`.

Backends (`backend=`; None picks by platform):
  "pallas"     Pallas Triton kernels (pallas_gpu.py), default on NVIDIA GPUs;
               `interpret=True` runs them anywhere (tests).
  "cpu"        native C++ kernel through XLA FFI (cpu/, cpu/cpu_native.cc), default on
               CPUs where it compiles (float32/bfloat16 pools).
  "tpu"        JAX's own TPU ragged kernel over a combined K/V pool (tpu.py), default on
               TPUs; TPU interpret mode elsewhere (tests).
  "xla"        gathers + einsums with an online softmax (xla.py), default elsewhere.
  "reference"  readable pure jnp (reference.py), the definition of the semantics.
Static hints `max_q_len` (1 = decode-only step) and `max_kv_len` (bound on kv_lens) let
a caller that knows its bucket skip work; results are identical when they hold.
"""

from .attention import (
    BACKENDS,
    LIMITLESS_BACKENDS,
    default_backend,
    ragged_paged_attention,
    validate_inputs,
)
from .reference import ragged_paged_attention_reference
from .write_kv import write_kv

__all__ = [
    "BACKENDS",
    "LIMITLESS_BACKENDS",
    "default_backend",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "validate_inputs",
    "write_kv",
]
