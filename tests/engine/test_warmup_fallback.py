"""An engine whose Pallas attention fails to compile serves with the XLA attention path: the
platform's compile probe decides it once, while the engine is built, with one warning naming
the cause; the runner and its steps only read the platform. A failure of any other backend
still stops the start-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.engine import LLMEngine
from jaxpaged.kernels import platform as platform_module
from jaxpaged.models.testing import random_params, tiny_config


def _engine(backend):
    cfg = tiny_config(head_dim=16)
    params = jax.tree.map(jnp.asarray, random_params(cfg))
    return LLMEngine.from_params(
        cfg, params, attention_backend=backend, max_model_len=32, max_num_seqs=2,
        max_num_batched_tokens=16, num_kv_blocks=8, block_size=8, enforce_eager=True,
    )  # fmt: skip


def _probe(monkeypatch, error=None):
    """Stands in for compiling the Pallas attention program: records what it was asked to
    compile and fails with ``error`` when given."""
    calls = []

    def probe(backend, shape, interpret):
        calls.append((backend, shape, interpret))
        if error is not None:
            raise error

    monkeypatch.setattr(platform_module, "probe_attention", probe)
    return calls


def test_pallas_compile_failure_falls_back_to_xla(monkeypatch, caplog):
    calls = _probe(monkeypatch, ValueError("Triton: out of shared memory\nmore detail"))
    with caplog.at_level("WARNING"):
        engine = _engine("pallas")
    try:
        # probed once, for the model's heads, pool blocks and dtypes (Pallas in interpret
        # mode on this CPU)
        ((backend, shape, interpret),) = calls
        assert (backend, interpret) == ("pallas", True)
        assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim) == (8, 2, 16)
        assert (shape.block_size, shape.kv_dtype) == (8, "float32")
        platform = engine.platform
        assert (platform.attention_backend, platform.interpret) == ("xla", False)
        runner = engine.runner
        assert runner.platform is platform and runner.backend == "xla"
        kwargs = runner._step_kwargs()
        assert (kwargs["backend"], kwargs["interpret"]) == ("xla", False)
        assert not engine.layout.combined
        (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
        assert "Pallas attention kernel failed to compile" in record.getMessage()
        assert "out of shared memory" in record.getMessage()
        assert "more detail" not in record.getMessage()
    finally:
        engine.close()


def test_pallas_that_compiles_is_kept(monkeypatch):
    calls = _probe(monkeypatch)
    engine = _engine("pallas")
    try:
        assert len(calls) == 1
        assert (engine.platform.attention_backend, engine.platform.interpret) == ("pallas", True)
        assert engine.runner._step_kwargs()["backend"] == "pallas"
    finally:
        engine.close()


def test_other_backends_failing_still_raise(monkeypatch):
    calls = _probe(monkeypatch, AssertionError("only Pallas is probed"))
    engine = _engine("xla")
    try:
        assert calls == [] and engine.platform.attention_backend == "xla"
        runner = engine.runner

        def compile_buckets(buckets, bar):
            raise ValueError("broken")

        monkeypatch.setattr(runner, "_compile_buckets", compile_buckets)
        with pytest.raises(ValueError, match="broken"):
            runner.warm_up(show_progress=False)
        assert runner.backend == "xla" and not runner.warmed_up
    finally:
        engine.close()
