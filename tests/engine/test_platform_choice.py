"""The engine's Platform, chosen once by the builder: reported in one log line, read by the
runner, and the only source of the attention backend its steps trace (never None)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.args import EngineArgs
from jaxpaged.engine import LLMEngine
from jaxpaged.kernels import cpu
from jaxpaged.kernels import pool_format as pool_format_module
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.worker.step import step

# a vocabulary no other test's engine has: the step programs below are traced afresh
CFG = tiny_config(head_dim=16, vocab_size=80)
SETTINGS = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=9,
                block_size=8, enforce_eager=True, show_progress=False)  # fmt: skip


def _engine(**kw) -> LLMEngine:
    params = jax.tree.map(jnp.asarray, random_params(CFG))
    return LLMEngine.from_params(CFG, params, **SETTINGS, **kw)


def _lower(runner, **overrides):
    batch, _ = runner.build_batch([], runner.buckets.all()[0])
    kwargs = {**runner._step_kwargs(), **overrides}
    return step.lower(runner.params, runner.pool, runner.seq_state, runner.sampled, batch, **kwargs)


@pytest.mark.parametrize("backend", [None, "xla", "reference", "pallas"])
def test_steps_trace_attention_with_the_platforms_backend_never_none(backend, monkeypatch):
    seen = []
    attend = pool_format_module.ragged_paged_attention

    def recording(*args, **kwargs):
        seen.append((kwargs["backend"], kwargs["interpret"]))
        return attend(*args, **kwargs)

    monkeypatch.setattr(pool_format_module, "ragged_paged_attention", recording)
    engine = _engine(attention_backend=backend)
    try:
        chosen = engine.platform.attention_backend
        assert chosen == backend or (backend is None and chosen in ("cpu", "xla"))
        if backend is None and cpu.available():
            assert chosen == "cpu"
        # Pallas off a GPU: interpret mode, passed down to every call
        interpret = backend == "pallas"
        assert engine.platform.interpret == interpret
        seen.clear()  # the probe's own calls, if any
        _lower(engine.runner)
        # one call per layer, each with the platform's resolved backend
        assert seen and set(seen) == {(chosen, interpret)}
    finally:
        engine.close()


def test_the_step_refuses_an_unresolved_backend():
    engine = _engine(attention_backend="xla")
    try:
        with pytest.raises(ValueError, match="resolved attention backend.*None"):
            _lower(engine.runner, backend=None)
    finally:
        engine.close()


def test_the_platform_is_reported_in_one_log_line(caplog):
    # the "jaxpaged" logger's level too: a command run in-process earlier (cli/terminal.py)
    # sets it for its own process
    with caplog.at_level(logging.INFO, logger="jaxpaged"):
        engine = _engine()
    engine.close()
    lines = [r.getMessage() for r in caplog.records if "platform:" in r.getMessage()]
    assert lines == [engine.platform.describe()]
    (line,) = lines
    if cpu.available():
        assert line == (
            "platform: cpu; attention cpu; KV pool K, V; linear native (float panels); "
            "argmax native; activations float32"
        )
    # the choice is logged there only, not again by the KV plan or the runner
    assert not [r for r in caplog.records if "attention path" in r.getMessage()]


def test_bad_backend_names_are_refused_by_name():
    with pytest.raises(ValueError, match="'triton'"):
        EngineArgs.from_kwargs(attention_backend="triton")
    params = jax.tree.map(jnp.asarray, random_params(CFG))
    with pytest.raises(ValueError, match="'triton'"):
        LLMEngine(model_config=CFG, params=params, tokenizer=None, attention_backend="triton")
