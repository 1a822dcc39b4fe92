"""One engine's :class:`Platform`: every decision that depends on where it runs, made once.

The engine builder calls :func:`choose_platform` with the devices' platform, the settings and
the model's attention shapes; the KV plan, the runner and the step only read the value. It
holds the attention backend (a resolved name, never None) and whether its Pallas kernel runs
in interpret mode, the KV pool's format, the layer implementation (:class:`XlaBackend`, or
:class:`~jaxpaged.kernels.cpu.backend.CpuBackend` on a CPU: the native matmul over packed
weights, the native argmax, the activation dtype, huge pages) and whether the KV pool is sized
from the device's memory. Where the asked-for kernel cannot serve the model (tensor
parallelism or ALiBi with JAX's TPU kernel, a dtype the native CPU kernel does not read, a
shape the Pallas kernel cannot tile or a Pallas program that fails to compile), the XLA path
is chosen here, for a stated reason. ``configure_process`` applies the platform's
process-wide settings, for callers that ask for them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from .attention import BACKENDS, default_backend, fallback_reason, ragged_paged_attention
from .cpu.backend import CpuBackend, WeightMap
from .cpu.host_malloc import jax_will_run_on_cpu
from .kv_quant import is_quantized
from .pool_format import PoolFormat, pool_format
from .step_kernels import XLA_KERNELS, StepKernels, argmax_xla

__all__ = [
    "AttentionShape",
    "LayerBackend",
    "Platform",
    "XlaBackend",
    "choose_platform",
    "configure_process",
    "probe_attention",
]

logger = logging.getLogger(__name__)


class LayerBackend(Protocol):
    """How the model's layers run on a platform: the step's matmul and argmax kernels, the
    weights' layout for them, and the memory the streamed weights live in. The platform's
    implementations of the model's shared layers (a Linear's kernel, its weight layout and
    packing, the CPU's fused norm / SiLU gate / residual epilogue) belong here, beside them."""

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
    """GPUs and TPUs (and sharded or forced-XLA CPU engines): XLA's matmuls and argmax, the
    weights as loaded."""

    @property
    def kernels(self) -> StepKernels:
        return XLA_KERNELS

    def pack_weights(self, params: Any, map_matmul_weights: WeightMap) -> Any:
        return params

    def back_with_huge_pages(self, arrays: Iterable[jax.Array]) -> int:
        return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """What one device's attention calls look like: the heads it holds, the pool's blocks
    and value dtype, and the queries' dtype (the model's activations)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str  # the pool's values; int8 / float8_e4m3fn: quantized, with scales
    q_dtype: str
    alibi: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Platform:
    """Where and how one engine runs; frozen, chosen once by :func:`choose_platform`."""

    device: str  # the JAX platform of the engine's devices: "cpu", "gpu", "tpu"
    attention_backend: str  # one of kernels.BACKENDS, never None
    interpret: bool  # the attention kernel is a Pallas one run off its own device
    pool_format: PoolFormat
    layers: LayerBackend  # XlaBackend, or CpuBackend on a CPU
    # the hidden states' dtype between layers: the params', or the wider one the layers
    # compute in (CpuBackend: bfloat16 weights under the float32 native matmul)
    activation_dtype: str
    # why attention_backend is not the one asked for (or the device's default), if it is not
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention backend must be one of {BACKENDS}, got {self.attention_backend!r}"
            )

    @property
    def kernels(self) -> StepKernels:
        """What the jitted step calls for the matmuls and greedy argmax."""
        return self.layers.kernels

    def pack_weights(self, params: Any, map_matmul_weights: WeightMap) -> Any:
        return self.layers.pack_weights(params, map_matmul_weights)

    def back_with_huge_pages(self, arrays: Iterable[jax.Array]) -> int:
        return self.layers.back_with_huge_pages(arrays)

    @property
    def sizes_kv_from_device_memory(self) -> bool:
        """The memory probe: an accelerator's KV pool takes what its memory has left after the
        weights and the step's scratch; a CPU's takes a configured byte budget."""
        return self.device != "cpu"

    def with_xla_attention(self, reason: str) -> Platform:
        """This platform with the XLA attention path (split pool) instead, for ``reason``."""
        return dataclasses.replace(
            self,
            attention_backend="xla",
            interpret=False,
            pool_format=pool_format("xla", quantized=self.pool_format.quantized),
            reasons=(*self.reasons, reason),
        )

    def describe(self) -> str:
        """One log line: what this platform chose."""
        attention = self.attention_backend + (" (interpret mode)" if self.interpret else "")
        if self.reasons:
            attention += f" ({'; '.join(self.reasons)})"
        fmt = self.pool_format
        pool = "combined K/V" if fmt.combined else "K, V"
        kernels = self.kernels
        layers = self.layers
        if kernels.linear is None:
            linear = "XLA dots"
        elif isinstance(layers, CpuBackend):
            if layers.grouped_weights:
                linear = "native (per weight: q4 groups, int8 or float panels)"
            else:
                linear = f"native ({'int8' if layers.int8_weights else 'float'} panels)"
        else:
            linear = getattr(kernels.linear, "__name__", repr(kernels.linear))
        argmax = "XLA" if kernels.argmax is argmax_xla else "native"
        return (
            f"platform: {self.device}; attention {attention}; KV pool {pool}"
            f"{' 8-bit with scales' if fmt.quantized else ''}; linear {linear}; argmax {argmax}; "
            f"activations {self.activation_dtype}"
        )


# probe(backend, shape, interpret): compiles that attention program or raises why not
Probe = Callable[[str, AttentionShape, bool], None]


def probe_attention(backend: str, shape: AttentionShape, interpret: bool) -> None:
    """Lowers and compiles ``backend``'s attention for these heads, pool blocks and dtypes,
    a decode step and a prefill step, on abstract inputs (nothing runs); raises what the
    compiler raises."""
    s = shape
    num_seqs, blocks_per_seq = 2, 4
    num_blocks = num_seqs * blocks_per_seq + 1
    quantized = is_quantized(s.kv_dtype)
    page = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    i32 = jnp.int32
    pool = [jax.ShapeDtypeStruct(page, s.kv_dtype)] * 2
    extra: dict[str, Any] = {}
    if quantized:
        scales = jax.ShapeDtypeStruct(page[:3], jnp.float32)
        extra.update(k_scales=scales, v_scales=scales)
    if s.alibi:
        extra["alibi_slopes"] = jax.ShapeDtypeStruct((s.num_q_heads,), jnp.float32)
    for num_tokens, max_q_len in ((num_seqs, 1), (num_seqs * s.block_size, None)):
        args = (
            jax.ShapeDtypeStruct((num_tokens, s.num_q_heads, s.head_dim), s.q_dtype),
            *pool,
            jax.ShapeDtypeStruct((num_seqs,), i32),
            jax.ShapeDtypeStruct((num_seqs, blocks_per_seq), i32),
            jax.ShapeDtypeStruct((num_seqs + 1,), i32),
            jax.ShapeDtypeStruct((1,), i32),
        )
        ragged_paged_attention.lower(
            *args, sm_scale=s.head_dim**-0.5, backend=backend, interpret=interpret,
            max_q_len=max_q_len, **extra,
        ).compile()  # fmt: skip


def choose_platform(
    params: Any,
    map_matmul_weights: WeightMap,
    *,
    device: str,
    attention_backend: str | None,
    shape: AttentionShape,
    tensor_parallel: bool = False,
    model_name: str | None = None,
    probe: Probe | None = None,
) -> Platform:
    """The platform of an engine over ``params`` on ``device`` (a JAX platform name).

    ``attention_backend``: the kernel asked for (a ValueError naming it if unknown), None for
    the device's default. ``shape``: one device's attention (its share of the heads under
    tensor parallelism), with ``q_dtype`` the params' dtype: the layers may widen it.
    ``probe`` compiles a Pallas attention program before the engine relies on it (default
    :func:`probe_attention`); where it fails the engine takes the XLA path, with one warning
    naming the cause.
    """
    if attention_backend is not None and attention_backend not in BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {BACKENDS} or None, got {attention_backend!r}"
        )
    device = "gpu" if device == "cuda" else device
    wanted = attention_backend or default_backend(device)
    if device == "cpu":
        layers: LayerBackend = CpuBackend.select(
            params, map_matmul_weights, attention_backend=wanted, sharded=tensor_parallel
        )
    else:
        layers = XlaBackend()
    q_dtype = layers.kernels.activation_dtype or shape.q_dtype
    shape = dataclasses.replace(shape, q_dtype=jnp.dtype(q_dtype).name)
    quantized = is_quantized(shape.kv_dtype)
    backend, reasons = wanted, []
    if wanted == "tpu" and (tensor_parallel or shape.alibi):
        if attention_backend == "tpu":  # asked for by name: refused by name
            from .tpu import refuse_alibi

            if tensor_parallel:
                raise ValueError(
                    "attention_backend='tpu' does not support tensor_parallel_size > 1 yet; "
                    "use attention_backend='xla' (--attention-backend xla)"
                )
            refuse_alibi(model_name)
        # the combined pool's padded heads do not split over devices like the model's, and
        # JAX's TPU kernel takes no logit bias
        backend = "xla"
        reasons.append("tensor parallelism on TPU" if tensor_parallel else "ALiBi on TPU")
    if attention_backend is None and backend == "cpu":
        # the default on a CPU: the native kernel where it reads these dtypes
        reason = fallback_reason(
            "cpu", q_dtype=shape.q_dtype, kv_dtype=shape.kv_dtype,
            num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, block_size=shape.block_size,
        )  # fmt: skip
        if reason is not None:
            backend = "xla"
            reasons.append(reason)
    # a Pallas kernel off its own device (tests, dry runs) runs in interpret mode
    own_device = {"pallas": "gpu", "tpu": "tpu"}.get(backend)
    interpret = own_device is not None and own_device != device
    platform = Platform(
        device=device,
        attention_backend=backend,
        interpret=interpret,
        pool_format=pool_format(backend, quantized=quantized),  # ValueError: 8-bit on "tpu"
        layers=layers,
        activation_dtype=shape.q_dtype,
        reasons=tuple(reasons),
    )
    if backend == "pallas":
        reason = _pallas_failure(platform, shape, probe or probe_attention)
        if reason is not None:
            logger.warning(
                "the Pallas attention kernel %s; serving with the XLA attention path instead "
                "(--attention-backend xla skips this attempt)",
                reason,
            )
            platform = platform.with_xla_attention("Pallas " + reason)
    return platform


def _pallas_failure(platform: Platform, shape: AttentionShape, probe: Probe) -> str | None:
    """Why the Pallas kernel cannot run this engine's attention, as a phrase ("cannot run
    this shape (...)", "failed to compile (...)"); None where it compiles."""
    s = shape
    reason = fallback_reason(
        "pallas", q_dtype=s.q_dtype, kv_dtype=s.kv_dtype, num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, block_size=s.block_size,
        interpret=platform.interpret,
    )  # fmt: skip
    if reason is not None:
        return f"cannot run this shape ({reason})"
    try:
        probe("pallas", shape, platform.interpret)
    except Exception as error:  # the compiler's own error types differ by version and device
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        return f"failed to compile ({type(error).__name__}: {first})"
    return None


def configure_process() -> bool:
    """The platform's process-wide settings (CpuBackend's on a CPU-only JAX, none elsewhere);
    call before JAX starts. Whether any applied."""
    if jax_will_run_on_cpu():
        return CpuBackend.configure_process()
    return False
