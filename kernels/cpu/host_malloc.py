"""glibc malloc settings that keep XLA:CPU's per-step buffers mapped between steps.

XLA:CPU mallocs each execution's scratch buffer and frees it when the execution ends. glibc
serves blocks above its mmap threshold (adaptive, at most 32 MiB) with a fresh ``mmap`` and
gives freed heap tops back to the OS (``M_TRIM_THRESHOLD``), so every batch-32 SmolLM2
decode step mapped its 36 MiB scratch anew and faulted in the ~11 MB it touches: ~2,800
minor page faults per step, each a trap and a zeroed page, then a TLB shootdown across the
cores at ``munmap``: 5-8.5 ms of system CPU time per ~64 ms step on the 2-core dev VM,
1.4-2.1 ms with the settings below (system CPU time per step, measured with getrusage).

With both thresholds above a step's buffers the block stays in the heap for the next step,
as a caching device allocator would. That alone is not enough: a step runs on whichever XLA
thread picks it up, glibc gives each thread its own arena, and a thread arena's heaps hold
at most 64 MiB and are unmapped as soon as they empty, so the scratch could still be mapped
anew every step. One arena for the whole process (``M_ARENA_MAX``) avoids that, but glibc
fixes the arena limit when a second thread first allocates: :func:`keep_step_buffers` must
run before JAX starts its threads, as ``python -m jaxpaged.serve`` and an engine loading its
model with ``configure_process=True`` do on a CPU-only JAX (``CpuBackend.configure_process``).
Called later it still raises the thresholds (most steps then reuse their scratch; measured,
sometimes not). The cost: freed blocks up to the thresholds stay resident, and threads share
one malloc lock, which XLA's threads barely take during a step.

Process-wide, so applied only when asked. ``JAXPAGED_MALLOC_TUNING=0`` leaves malloc as it is
even then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from collections.abc import Callable
from importlib.metadata import entry_points

import jax

__all__ = ["STEP_BUFFER_BYTES", "jax_will_run_on_cpu", "keep_step_buffers", "libc_function"]

# Above the scratch of the default engine's largest step program (72 MiB for SmolLM2 at
# max_num_batched_tokens=2048) with room for its outputs: blocks up to this size are reused
# from the heap, larger ones (the weights, the KV pool) still get their own mappings.
STEP_BUFFER_BYTES = 256 << 20

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def libc_function(
    symbol: str, argtypes: tuple[type, ...], *, use_errno: bool = False
) -> Callable[..., int] | None:
    """The C library's ``symbol`` (returning int) through ctypes, or None where there is no
    such C library or function (another OS, another libc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(name, use_errno=use_errno), symbol)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def keep_step_buffers(max_bytes: int = STEP_BUFFER_BYTES) -> bool:
    """Makes glibc reuse freed blocks up to ``max_bytes`` instead of unmapping them, from one
    arena. Returns False (and changes nothing) where the C library has no ``mallopt`` (not
    glibc) or ``JAXPAGED_MALLOC_TUNING=0``. Idempotent."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if os.environ.get("JAXPAGED_MALLOC_TUNING", "1") == "0":
        return False
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        return False
    value = min(max_bytes, 2**31 - 1)
    # setting a threshold also stops glibc from adapting them
    return all(
        mallopt(param, v)
        for param, v in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, value), (_M_TRIM_THRESHOLD, value))
    )


def jax_will_run_on_cpu() -> bool:
    """Whether JAX's default backend is (or, not started yet, will be) the CPU, decided
    without starting it: ``JAX_PLATFORMS`` if set, else no accelerator plugin installed."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return jax.default_backend() == "cpu"
    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not (
        entry_points(group="jax_plugins")
        or importlib.util.find_spec("jax_plugins") is not None
        or importlib.util.find_spec("libtpu") is not None
    )
