"""choose_platform: the one place an engine's attention backend, pool format, layer kernels
and fallbacks are decided, from the device, the settings and the model's attention shapes."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from jaxpaged.kernels import cpu
from jaxpaged.kernels.cpu.backend import CpuBackend
from jaxpaged.kernels.platform import (
    AttentionShape,
    Platform,
    XlaBackend,
    choose_platform,
    probe_attention,
)
from jaxpaged.kernels.pool_format import PoolFormat
from jaxpaged.kernels.step_kernels import argmax_xla


def _shape(**kw) -> AttentionShape:
    base = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8, kv_dtype="float32",
                q_dtype="float32")  # fmt: skip
    return AttentionShape(**{**base, **kw})


def _params(dtype=jnp.float32):
    # one stacked matmul weight [L, out, in] whose output size the native panels tile
    return {"w": jnp.zeros((2, 32, 16), dtype)}


def _weight_map(params, fn):
    return {"w": fn(params["w"])}


class Probe:
    """Records each probe; fails with ``error`` when given."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple[str, AttentionShape, bool]] = []
        self.error = error

    def __call__(self, backend, shape, interpret) -> None:
        self.calls.append((backend, shape, interpret))
        if self.error is not None:
            raise self.error


def _choose(device="cpu", backend=None, *, params=None, probe=None, **kw) -> Platform:
    shape_kw = {k: kw.pop(k) for k in list(kw) if k in AttentionShape.__dataclass_fields__}
    return choose_platform(
        _params() if params is None else params,
        _weight_map,
        device=device,
        attention_backend=backend,
        shape=_shape(**shape_kw),
        probe=probe or Probe(),
        **kw,
    )


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernels")
def test_cpu_default_is_the_native_kernels():
    p = _choose("cpu")
    assert (p.attention_backend, p.interpret, p.reasons) == ("cpu", False, ())
    assert p.pool_format == PoolFormat(combined=False)
    assert isinstance(p.layers, CpuBackend) and p.layers.native_attention
    assert p.kernels.linear is cpu.linear and p.kernels.argmax is cpu.argmax
    assert not p.sizes_kv_from_device_memory and p.activation_dtype == "float32"
    # bfloat16 weights under the float32 native matmul: float32 activations, and the native
    # attention reads float32 queries over the bfloat16 pool
    bf16 = _choose("cpu", params=_params(jnp.bfloat16), q_dtype="bfloat16", kv_dtype="bfloat16")
    assert (bf16.attention_backend, bf16.activation_dtype) == ("cpu", "float32")


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernels")
def test_cpu_default_takes_xla_attention_for_a_dtype_the_native_kernel_does_not_read():
    p = _choose("cpu", params=_params(jnp.float16), q_dtype="float16", kv_dtype="float16")
    assert p.attention_backend == "xla" and "float16" in p.reasons[0]
    # the layers keep what the CPU has for them: the native argmax (no float16 matmul)
    assert p.kernels.linear is None and p.kernels.argmax is cpu.argmax


def test_forced_xla_on_cpu_is_xla_everywhere():
    p = _choose("cpu", "xla")
    assert (p.attention_backend, p.interpret, p.pool_format.combined) == ("xla", False, False)
    assert p.kernels.linear is None and p.kernels.argmax is argmax_xla


def test_forced_pallas_off_a_gpu_runs_in_interpret_mode_after_a_probe():
    probe = Probe()
    p = _choose("cpu", "pallas", probe=probe)
    assert (p.attention_backend, p.interpret, p.pool_format.combined) == ("pallas", True, False)
    assert probe.calls == [("pallas", _shape(), True)]


def test_forced_tpu_off_a_tpu_is_the_combined_pool_in_interpret_mode():
    probe = Probe()
    p = _choose("cpu", "tpu", probe=probe)
    assert (p.attention_backend, p.interpret, p.pool_format.combined) == ("tpu", True, True)
    assert probe.calls == []  # only the Pallas GPU kernel has an XLA fallback


def test_accelerator_defaults():
    tpu = _choose("tpu")
    assert (tpu.attention_backend, tpu.interpret, tpu.pool_format.combined) == ("tpu", False, True)
    assert tpu.layers == XlaBackend() and tpu.sizes_kv_from_device_memory
    probe = Probe()
    gpu = _choose("gpu", probe=probe)
    assert (gpu.attention_backend, gpu.interpret) == ("pallas", False)
    assert probe.calls == [("pallas", _shape(), False)]
    assert _choose("cuda").device == "gpu"


def test_pallas_compile_failure_is_one_warning_and_the_xla_path(caplog):
    probe = Probe(RuntimeError("Triton: out of shared memory\nmore detail"))
    with caplog.at_level(logging.WARNING, logger="jaxpaged.kernels.platform"):
        p = _choose("gpu", probe=probe)
    assert (p.attention_backend, p.interpret, p.pool_format.combined) == ("xla", False, False)
    (record,) = caplog.records
    message = record.getMessage()
    assert "Pallas attention kernel failed to compile" in message
    assert "out of shared memory" in message and "more detail" not in message
    assert "out of shared memory" in p.describe()


def test_a_shape_pallas_cannot_tile_takes_xla_without_compiling(caplog):
    probe = Probe()
    with caplog.at_level(logging.WARNING, logger="jaxpaged.kernels.platform"):
        p = _choose("gpu", probe=probe, head_dim=48)
    assert p.attention_backend == "xla" and probe.calls == []
    (record,) = caplog.records
    assert "head_dim must be a power of two" in record.getMessage()


def test_tpu_kernel_limits_move_the_default_to_xla_and_refuse_the_named_backend():
    for kw, why in (
        (dict(tensor_parallel=True), "tensor parallelism"),
        (dict(alibi=True), "ALiBi"),
    ):
        p = _choose("tpu", **kw)
        assert p.attention_backend == "xla" and not p.pool_format.combined
        assert why in p.reasons[0]
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        _choose("tpu", "tpu", tensor_parallel=True)
    with pytest.raises(ValueError, match="bloom.*ALiBi"):
        _choose("cpu", "tpu", alibi=True, model_name="bloom")
    with pytest.raises(ValueError, match="cannot read a int8 KV cache"):
        _choose("cpu", "tpu", kv_dtype="int8")


def test_unknown_backends_are_refused_by_name():
    with pytest.raises(ValueError, match="'triton'"):
        _choose("cpu", "triton")
    with pytest.raises(ValueError, match="None"):
        Platform(device="cpu", attention_backend=None, interpret=False,
                 pool_format=PoolFormat(combined=False), layers=XlaBackend(),
                 activation_dtype="float32")  # fmt: skip


def test_an_8bit_pool_is_quantized_in_the_format():
    p = _choose("cpu", "xla", kv_dtype="int8")
    assert p.pool_format == PoolFormat(combined=False, quantized=True)
    assert "8-bit" in p.describe()


def test_the_description_names_every_choice():
    line = _choose("cpu", "xla").describe()
    assert line == (
        "platform: cpu; attention xla; KV pool K, V; linear XLA dots; argmax XLA; "
        "activations float32"
    )


def test_the_probe_compiles_pallas_in_interpret_mode_and_fails_off_a_gpu():
    """The real probe: the Pallas kernel compiles for these shapes in interpret mode; without
    interpret mode, on a CPU, its compile fails (what makes a GPU engine fall back)."""
    probe_attention("pallas", _shape(), True)
    with pytest.raises(Exception, match=r"(?i)interpret"):
        probe_attention("pallas", _shape(), False)
