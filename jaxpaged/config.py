"""Engine configuration: frozen, keyword-only dataclasses validated at construction.

* :class:`ModelConfig` (re-exported from :mod:`jaxpaged.models.config`): the architecture.
* :class:`CacheConfig`: the paged KV cache (block size, how many blocks, swap space, prefix
  caching). The runner turns it into a block count (see :mod:`jaxpaged.worker.kv_cache`).
* :class:`SchedulerConfig`: per-step limits and the preemption mode. Chunked prefill is always
  on: a prompt longer than the step's token budget is split over several steps.
* :class:`ParallelConfig`: tensor parallelism over a device mesh.
* :class:`ProcessConfig`: the process-wide settings an engine applies only when asked.
* :class:`LoraConfig`: multi-LoRA serving (adapter slots, their rank, adapters at start-up).

Every bad value raises ``ValueError`` naming the field, so a typo in a flag fails at start-up
and not in the middle of serving.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxpaged.models.config import ModelConfig

__all__ = [
    "GiB",
    "CacheConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "PreemptionMode",
    "ProcessConfig",
    "SCHEDULING_POLICIES",
    "SchedulerConfig",
]

GiB = 1 << 30

PreemptionMode = Literal["recompute", "swap"]
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap")
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")
# where evicted prefix-cache blocks go (vLLM's --kv-offloading-backend): host memory, managed
# by the engine itself
KV_OFFLOADING_BACKENDS: tuple[str, ...] = ("native",)
# KV pool dtypes: the model's, bfloat16, or 8-bit with per-(token, head) scales
# (fp8 = float8_e4m3fn; kernels/kv_quant.py)
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "fp8", "int8")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The paged KV cache.

    Block count: ``num_kv_blocks`` if given; else, on GPU, what is left of
    ``gpu_memory_utilization`` * device memory after weights and a profiling step; else (CPU)
    ``kv_cache_memory`` bytes (None = the runner's default). ``swap_space`` is GiB of host
    memory for blocks of preempted requests (``preemption_mode="swap"``); the scheduler turns
    it into host slots with the runner's bytes-per-block. ``kv_offloading_size`` is GiB of host
    memory for a tier of the prefix cache (vLLM's ``--kv-offloading-size``; None or 0: off):
    full blocks evicted from the device pool are kept there, least recently used out, and a
    later prefix hit copies them back (:mod:`jaxpaged.sched.host_tier`);
    ``kv_offloading_backend`` must be ``native`` or None (this engine's own host tier).
    ``kv_offloading_disk_dir`` / ``kv_offloading_disk_size`` (GiB): a disk tier behind the
    host tier, which takes the blocks the host tier forgets (the folder's files are this
    engine's scratch, overwritten freely).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES; auto = the model's dtype
    kv_offloading_size: float | None = None  # GiB of host memory for the prefix-cache tier
    kv_offloading_backend: str | None = None  # one of KV_OFFLOADING_BACKENDS; None: native
    kv_offloading_disk_dir: str | None = None  # a folder for a disk tier behind the host's
    kv_offloading_disk_size: float | None = None  # GiB of it

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not _is_int(self.num_kv_blocks) or self.num_kv_blocks < 1
        ):
            raise ValueError(f"num_kv_blocks must be an int >= 1, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None and (
            not _is_int(self.kv_cache_memory) or self.kv_cache_memory < 1
        ):
            raise ValueError(
                f"kv_cache_memory must be a positive int (bytes), got {self.kv_cache_memory!r}"
            )
        if not _is_real(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if not _is_real(self.swap_space) or self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if self.kv_offloading_backend not in (None, *KV_OFFLOADING_BACKENDS):
            raise ValueError(
                f"kv_offloading_backend {self.kv_offloading_backend!r} is not supported: "
                f"jaxpaged offloads to host memory itself ({', '.join(KV_OFFLOADING_BACKENDS)})"
            )
        size = self.kv_offloading_size
        if size is not None and (not _is_real(size) or size < 0):
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {size!r}")
        disk, disk_size = self.kv_offloading_disk_dir, self.kv_offloading_disk_size
        if disk_size is not None and (not _is_real(disk_size) or disk_size < 0):
            raise ValueError(f"kv_offloading_disk_size must be >= 0 GiB, got {disk_size!r}")
        if disk is not None and (not isinstance(disk, str) or not disk):
            raise ValueError(f"kv_offloading_disk_dir must be a folder path, got {disk!r}")
        if bool(disk) != bool(disk_size) or (disk and not size):
            raise ValueError(
                "kv_offloading_disk_dir and kv_offloading_disk_size go together, and with "
                "kv_offloading_size (the disk tier sits behind the host tier)"
            )
        if size and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size: the host tier keeps prefix-cache blocks, so it needs "
                "enable_prefix_caching (drop --no-enable-prefix-caching)"
            )

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * GiB)

    def num_host_blocks(self, bytes_per_block: int) -> int:
        """Host slots the swap space holds, for blocks of ``bytes_per_block`` bytes."""
        if not _is_int(bytes_per_block) or bytes_per_block < 1:
            raise ValueError(f"bytes_per_block must be a positive int, got {bytes_per_block!r}")
        return self.swap_space_bytes // bytes_per_block

    def num_tier_blocks(self, bytes_per_block: int) -> int:
        """Blocks of ``bytes_per_block`` bytes the host tier (``kv_offloading_size``) holds."""
        if not _is_int(bytes_per_block) or bytes_per_block < 1:
            raise ValueError(f"bytes_per_block must be a positive int, got {bytes_per_block!r}")
        return round((self.kv_offloading_size or 0) * GiB) // bytes_per_block

    def num_disk_blocks(self, bytes_per_block: int) -> int:
        """Blocks the disk tier (``kv_offloading_disk_size``) holds."""
        if not _is_int(bytes_per_block) or bytes_per_block < 1:
            raise ValueError(f"bytes_per_block must be a positive int, got {bytes_per_block!r}")
        return round((self.kv_offloading_disk_size or 0) * GiB) // bytes_per_block


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiModalConfig:
    """Images of a vision-language model: at most ``limit_images_per_prompt`` per prompt;
    the encoder cache keeps ``encoder_cache_images`` encoded images beyond the most that one
    step reads (jaxpaged.worker.images)."""

    limit_images_per_prompt: int = 4
    encoder_cache_images: int = 16

    def __post_init__(self) -> None:
        for name in ("limit_images_per_prompt", "encoder_cache_images"):
            value = getattr(self, name)
            least = 1 if name.startswith("limit") else 0
            if not _is_int(value) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Per-step limits. ``max_num_batched_tokens`` is the step's token budget (prefill chunks
    plus one token per decode); ``max_num_seqs`` bounds the running requests, hence the
    sequences in one step; ``max_model_len`` bounds prompt + output of one request.
    ``max_prefill_tokens_with_decodes``: in a step that also carries decodes, the most
    tokens its prefill chunks take together (None: the whole budget, or, with
    ``prefill_stall_ratio``, what the engine measures at warm-up keeps such a step within that
    many decode steps' time: :mod:`jaxpaged.engine.prefill_budget`), so that a prompt arriving
    does not hold every running decode up for the length of its prefill;
    ``fit_prefill_to_buckets`` lowers that cap to end the step on a compiled size."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = "recompute"
    # fcfs: first come first served; priority: lowest SamplingParams.priority first (then
    # arrival), and preemption takes the lowest priority (highest value) first
    scheduling_policy: str = "fcfs"
    max_prefill_tokens_with_decodes: int | None = None
    prefill_stall_ratio: float | None = None
    fit_prefill_to_buckets: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and (not _is_int(cap) or cap < 1):
            raise ValueError(f"max_prefill_tokens_with_decodes must be an int >= 1, got {cap!r}")
        stall = self.prefill_stall_ratio
        if stall is not None and (
            isinstance(stall, bool) or not isinstance(stall, int | float) or not stall > 1
        ):
            raise ValueError(f"prefill_stall_ratio must be a number > 1, got {stall!r}")
        if not isinstance(self.fit_prefill_to_buckets, bool):
            raise ValueError(
                f"fit_prefill_to_buckets must be a bool, got {self.fit_prefill_to_buckets!r}"
            )
        if self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (one prompt token and one output token), "
                f"got {self.max_model_len}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor parallelism: weights and the KV pool are split over this many devices; data
    parallelism: this many engine replicas, each on its own ``tensor_parallel_size`` devices
    (jaxpaged.engine.data_parallel)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_health_check_period: float = 10.0  # seconds (jaxpaged.engine.dp_health)
    data_parallel_max_restarts: int = 3  # per replica within dp_health.RESTART_WINDOW

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        period = self.data_parallel_health_check_period
        if not _is_real(period) or period <= 0:
            raise ValueError(
                f"data_parallel_health_check_period must be seconds > 0, got {period!r}"
            )
        restarts = self.data_parallel_max_restarts
        if not _is_int(restarts) or restarts < 0:
            raise ValueError(f"data_parallel_max_restarts must be an int >= 0, got {restarts!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessConfig:
    """Process-wide settings, applied only when asked: an engine built from research code
    leaves ``os.environ``, ``jax.config`` and malloc as it found them; ``python -m
    jaxpaged.serve`` and ``python -m jaxpaged.generate`` ask, since they own their process.

    ``configure_process``: before JAX starts, no accelerator preallocation and an allocator
    limit of ``gpu_memory_utilization`` (``XLA_PYTHON_CLIENT_*``), and on a CPU-only JAX the
    malloc tuning that lets XLA reuse each step's scratch (kernels/cpu/host_malloc.py).
    ``compile_cache_dir``: the folder of JAX's persistent compilation cache, set in
    ``jax.config``; None leaves ``jax.config`` alone. ``program_cache_dir``: a folder where
    the engine keeps its compiled step programs whole, so the next process loads them
    without tracing (jaxpaged.worker.program_store); None: off. ``huge_pages``: move the
    weights a CPU step streams onto 2 MiB pages at load (kernels/cpu/huge_pages.py: up to
    ~0.3 s of CPU once, for ~1.8 ms a batch-32 step); a one-shot command skips it.
    """

    configure_process: bool = False
    compile_cache_dir: str | None = None
    program_cache_dir: str | None = None
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.configure_process, bool):
            raise ValueError(f"configure_process must be a bool, got {self.configure_process!r}")
        if self.compile_cache_dir is not None and (
            not isinstance(self.compile_cache_dir, str) or not self.compile_cache_dir
        ):
            raise ValueError(
                "compile_cache_dir must be a folder (a non-empty str) or None, got "
                f"{self.compile_cache_dir!r}"
            )
        if not isinstance(self.huge_pages, bool):
            raise ValueError(f"huge_pages must be a bool, got {self.huge_pages!r}")
        if self.program_cache_dir is not None and (
            not isinstance(self.program_cache_dir, str) or not self.program_cache_dir
        ):
            raise ValueError(
                "program_cache_dir must be a folder (a non-empty str) or None, got "
                f"{self.program_cache_dir!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Multi-LoRA serving: ``max_loras`` adapters on the device at once (each of rank up to
    ``max_lora_rank``), ``modules`` the (name, PEFT folder) pairs registered at start-up.
    Off (``enable_lora`` False), nothing LoRA is compiled or allocated."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora=True (--enable-lora)")
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: adapter names must be unique, got {names}")

    @staticmethod
    def parse_modules(modules: object) -> tuple[tuple[str, str], ...]:
        """(name, path) pairs from ``["name=path", ...]`` (the command line's form) or a
        mapping name -> path; ValueError naming a malformed entry."""
        items = modules.items() if isinstance(modules, dict) else None
        if items is None:
            if isinstance(modules, str):
                modules = [modules]
            items = []
            for entry in modules:
                name, sep, path = str(entry).partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"lora_modules: expected name=path, got {entry!r}")
                items.append((name, path))
        return tuple((str(n), str(p)) for n, p in items)
