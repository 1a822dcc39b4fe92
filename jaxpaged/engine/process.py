"""The process-wide settings an engine applies only when its caller asks
(:class:`~jaxpaged.config.ProcessConfig`): environment variables and malloc
(``configure_process``), and JAX's persistent compile cache (``compile_cache_dir``). Research
code that builds an engine keeps its process as it was; ``python -m jaxpaged.serve`` and
``python -m jaxpaged.generate`` own theirs and ask (:func:`process_owner_args`).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpaged.config import ProcessConfig
from jaxpaged.kernels import platform
from jaxpaged.worker.compile_counter import default_compile_cache_dir, enable_persistent_cache
from jaxpaged.worker.kv_cache import configure_device_memory
from jaxpaged.worker.program_store import ProgramStore

__all__ = ["apply_process_config", "configure_process", "process_owner_args", "program_store"]


def configure_process(gpu_memory_utilization: float) -> None:
    """Settings that only take before JAX starts (later, only the malloc thresholds do):
    device memory for the KV pool (kv_cache.configure_device_memory) and the platform's own
    (on a CPU-only JAX, the malloc tuning that lets XLA reuse each step's scratch).
    Idempotent."""
    configure_device_memory(gpu_memory_utilization)
    platform.configure_process()


def apply_process_config(config: ProcessConfig, *, gpu_memory_utilization: float) -> str | None:
    """Applies what ``config`` asks for, and nothing else. Returns the persistent compile
    cache folder in use (whoever set it), or None."""
    if config.configure_process:
        configure_process(gpu_memory_utilization)
    if config.compile_cache_dir is not None:
        enable_persistent_cache(config.compile_cache_dir)
    return jax.config.jax_compilation_cache_dir or None


def process_owner_args() -> dict[str, Any]:
    """The EngineArgs settings of a program that owns its process (serve, generate, the
    benchmarks): configure it, and keep compiled programs in the default compile cache."""
    return {"configure_process": True, "compile_cache_dir": default_compile_cache_dir()}


def program_store(folder: str | None, mesh: jax.sharding.Mesh | None) -> ProgramStore | None:
    """The store of an engine's compiled programs in ``folder`` (None: none). Only for an
    engine on one device: a program over a mesh is traced as before."""
    return None if folder is None or mesh is not None else ProgramStore(folder)
