"""Warm-up falls back to the XLA attention path, with one warning naming the cause, when the
Pallas kernel fails to compile; a failure of any other backend still stops the start-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config


@pytest.fixture(scope="module")
def engine():
    cfg = tiny_config(head_dim=16)
    params = jax.tree.map(jnp.asarray, random_params(cfg))
    return LLMEngine.from_params(
        cfg, params, attention_backend="pallas", max_model_len=32, max_num_seqs=2,
        max_num_batched_tokens=16, num_kv_blocks=8, block_size=8, enforce_eager=True,
    )  # fmt: skip


def _failing_once(runner, message):
    """Stands in for compiling the step buckets: fails the first time, records the backend
    each attempt ran with."""
    attempts = []

    def compile_buckets(buckets, bar):
        attempts.append(runner.backend)
        if len(attempts) == 1:
            raise ValueError(message)

    return attempts, compile_buckets


def test_pallas_compile_failure_falls_back_to_xla(engine, monkeypatch, caplog):
    runner = engine.runner
    monkeypatch.setattr(runner, "backend", "pallas")
    attempts, fake = _failing_once(runner, "Triton: out of shared memory\nmore detail")
    monkeypatch.setattr(runner, "_compile_buckets", fake)
    with caplog.at_level("WARNING", logger="jaxpaged.worker.runner"):
        runner.warm_up(show_progress=False)
    assert attempts == ["pallas", "xla"] and runner.backend == "xla" and runner.warmed_up
    (record,) = caplog.records
    assert "Pallas attention kernel failed to compile" in record.getMessage()
    assert "out of shared memory" in record.getMessage()


def test_other_backends_failing_still_raise(engine, monkeypatch):
    runner = engine.runner
    monkeypatch.setattr(runner, "backend", "xla")
    attempts, fake = _failing_once(runner, "broken")
    monkeypatch.setattr(runner, "_compile_buckets", fake)
    with pytest.raises(ValueError, match="broken"):
        runner.warm_up(show_progress=False)
    assert attempts == ["xla"]
