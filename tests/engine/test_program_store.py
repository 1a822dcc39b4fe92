"""Compiled programs kept whole on disk (jaxpaged.worker.program_store): an engine that loads
them gives the tokens of one that traced its own, compiling nothing; and the key a program is
stored under changes with everything that determines the program."""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.program_key import (
    Unkeyable,
    argument_text,
    environment_text,
    program_key,
    source_digest,
)
from jaxpaged.worker.program_store import ProgramStore


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return cfg, jax.tree.map(jnp.asarray, random_params(cfg))


def _one_sequence_engine(tiny, **kwargs) -> LLMEngine:
    """As `jaxpaged generate` builds it: one sequence, programs compiled when first needed."""
    cfg, params = tiny
    return LLMEngine.from_params(
        cfg, params, max_model_len=64, max_num_seqs=1, num_kv_blocks=8, block_size=8,
        enforce_eager=True, **kwargs,
    )  # fmt: skip


def _greedy(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """(tokens, compilations during the request)."""
    before = engine.get_stats().num_compilations
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("r", prompt, greedy, output_kind=RequestOutputKind.FINAL_ONLY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens, engine.get_stats().num_compilations - before


def test_loaded_programs_give_the_traced_engines_tokens_and_compile_nothing(tiny, tmp_path):
    prompt = list(range(3, 23))  # 20 tokens: a prefill over three blocks, then decodes
    want, _ = _greedy(_one_sequence_engine(tiny), prompt)  # plain jit, no store
    assert len(want) == 12

    first = _one_sequence_engine(tiny, program_cache_dir=str(tmp_path))
    got, compiled = _greedy(first, prompt)
    store = first.runner.programs.step.store
    assert got == want and compiled > 0
    assert store.stored >= 3 and store.loaded == 0  # the pool, a prefill and a decode step
    assert len(os.listdir(tmp_path)) == store.stored

    second = _one_sequence_engine(tiny, program_cache_dir=str(tmp_path))
    got, compiled = _greedy(second, prompt)
    assert got == want and compiled == 0
    assert second.runner.programs.step.store.loaded == store.stored


@functools.partial(jax.jit, static_argnames=("scale",))
def _scaled(x, *, scale):  # float [N] -> [N]
    return x * scale


def test_the_key_changes_with_what_determines_the_program():
    env, src = environment_text(), source_digest()
    assert not re.search(r"0x[0-9a-fA-F]{6,}", env)  # nothing that differs per process
    assert src == source_digest()

    def key(x, scale=2, *, environment=env, source=src):
        return program_key("scaled", {"scale": scale}, ((x,), {}), environment=environment,
                           source=source)  # fmt: skip

    x = np.zeros(4, np.float32)
    base = key(x)
    assert base == key(np.ones(4, np.float32))  # values are not part of a program
    others = [
        key(np.zeros(5, np.float32)),  # shape
        key(np.zeros(4, np.int32)),  # dtype
        key(x, scale=3),  # a static argument
        key(x, source=src[::-1]),  # jaxpaged's code
        key(x, environment=env + "\nJAXPAGED_X=1"),  # versions, machine, settings
    ]
    assert len({base, *others}) == 6
    assert program_key("other", {"scale": 2}, ((x,), {}), environment=env, source=src) != base


def test_arguments_without_a_stable_text_are_not_keyed():
    assert argument_text((1, "a", None, jnp.float32)) == argument_text((1, "a", None, jnp.float32))
    for unstable in (lambda: 0, object()):
        with pytest.raises(Unkeyable):
            argument_text(unstable)


def test_a_store_folder_must_be_named_and_keeps_the_newest_programs(tmp_path):
    with pytest.raises(ValueError, match="program store folder"):
        ProgramStore("")
    for i in range(4):
        (tmp_path / f"{i}.jpprog").write_bytes(b"")
        os.utime(tmp_path / f"{i}.jpprog", (i, i))
    ProgramStore(str(tmp_path)).prune(keep=2)
    assert sorted(os.listdir(tmp_path)) == ["2.jpprog", "3.jpprog"]
