"""Which devices each data-parallel replica sees: environment variables set when its process
starts, before JAX does (jaxpaged.engine.data_parallel). Plain Python; no JAX."""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["replica_environments"]

_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def replica_environments(
    data_parallel_size: int,
    tensor_parallel_size: int,
    *,
    platform: str,
    num_devices: int,
    environ: Mapping[str, str],
) -> list[dict[str, str]]:
    """The environment variables that give each replica its own devices: on GPUs a slice of
    the visible devices (``CUDA_VISIBLE_DEVICES``, which ROCm honours too), on the CPU its own
    ``tensor_parallel_size`` simulated devices. ValueError when the
    ``data_parallel_size * tensor_parallel_size`` devices are not there, or on a platform
    whose devices one process holds (TPU)."""
    needed = data_parallel_size * tensor_parallel_size
    if needed > num_devices:
        raise ValueError(
            f"data_parallel_size {data_parallel_size} x tensor_parallel_size "
            f"{tensor_parallel_size} needs {needed} devices; {num_devices} {platform} "
            "device(s) are available"
        )
    tp = tensor_parallel_size
    if platform == "cpu":
        flags = _COUNT_FLAG.sub("", environ.get("XLA_FLAGS", "")).split()
        flags.append(f"--xla_force_host_platform_device_count={tp}")
        env = {"XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
        return [dict(env) for _ in range(data_parallel_size)]
    if platform in ("gpu", "cuda", "rocm"):
        given = environ.get("CUDA_VISIBLE_DEVICES")
        visible = given.split(",") if given else [str(i) for i in range(num_devices)]
        return [
            {"CUDA_VISIBLE_DEVICES": ",".join(visible[r * tp : (r + 1) * tp])}
            for r in range(data_parallel_size)
        ]
    raise ValueError(
        f"data_parallel_size > 1 is not supported on {platform} yet (one process holds all "
        "its chips): run one server per group of chips behind a balancer, or Ray Serve "
        "(docs/scaling.md)"
    )
