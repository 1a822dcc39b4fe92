"""The platform's part of an engine behind one interface, chosen once per engine.

``select_backend`` gives :class:`~jaxpaged.kernels.cpu.backend.CpuBackend` on a CPU (native
kernels, packed weights, huge pages) and :class:`XlaBackend` elsewhere. The runner asks it for
the step's :class:`StepKernels`, to pack the weights for them and to back the weights a step
streams; the step and the model code only see the StepKernels. ``configure_process`` applies
the platform's process-wide settings, for callers that ask for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import jax

from .cpu.backend import CpuBackend, WeightMap
from .cpu.host_malloc import jax_will_run_on_cpu
from .step_kernels import XLA_KERNELS, StepKernels

__all__ = ["PlatformBackend", "XlaBackend", "configure_process", "select_backend"]


class PlatformBackend(Protocol):
    @property
    def kernels(self) -> StepKernels: ...

    def pack_weights(self, params: Any, map_matmul_weights: WeightMap) -> Any:
        """The params in the layout ``kernels`` reads."""
        ...

    def back_with_huge_pages(self, arrays: Iterable[jax.Array]) -> int:
        """Backs the weights a step streams with large pages where it helps; bytes moved."""
        ...


@dataclasses.dataclass(frozen=True)
class XlaBackend:
    """GPUs and TPUs: XLA's matmuls and argmax, the weights as loaded (the attention kernel
    is picked by ``default_backend``)."""

    @property
    def kernels(self) -> StepKernels:
        return XLA_KERNELS

    def pack_weights(self, params: Any, map_matmul_weights: WeightMap) -> Any:
        return params

    def back_with_huge_pages(self, arrays: Iterable[jax.Array]) -> int:
        return 0


def select_backend(
    params: Any,
    map_matmul_weights: WeightMap,
    *,
    attention_backend: str | None,
    sharded: bool,
    platform: str | None = None,
) -> PlatformBackend:
    """The backend of an engine over ``params`` on ``platform`` (default: JAX's)."""
    if (platform or jax.default_backend()) == "cpu":
        return CpuBackend.select(
            params, map_matmul_weights, attention_backend=attention_backend, sharded=sharded
        )
    return XlaBackend()


def configure_process() -> bool:
    """The platform's process-wide settings (CpuBackend's on a CPU-only JAX, none elsewhere);
    call before JAX starts. Whether any applied."""
    if jax_will_run_on_cpu():
        return CpuBackend.configure_process()
    return False
