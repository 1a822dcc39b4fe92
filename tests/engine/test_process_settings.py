"""An engine changes nothing process-wide unless its caller asks (EngineArgs.configure_process,
compile_cache_dir): os.environ, jax.config's compile cache and glibc malloc stay as they were
for research code, and change with the opt-in. One fresh process (the settings are
process-wide), on a tiny random model: first research code's engines, then (its process
still as it was, which the first test asserts) the opt-in's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import jax
    from jaxpaged.kernels.cpu import host_malloc

    malloc_tuned = []  # the one function that applies the malloc settings, watched
    tune = host_malloc.keep_step_buffers

    def watched(*args, **kwargs):
        malloc_tuned.append(tune(*args, **kwargs))
        return malloc_tuned[-1]

    host_malloc.keep_step_buffers = watched

    import jaxpaged
    from jaxpaged.engine import LLMEngine
    from jaxpaged.models.testing import random_params, tiny_config
    from jaxpaged.worker.compile_counter import default_compile_cache_dir

    default_cache = default_compile_cache_dir()
    cfg = tiny_config(max_position_embeddings=64)
    params = jax.tree.map(jax.numpy.asarray, random_params(cfg))
    results = {}
    for case, opt_in in json.loads(sys.argv[1]).items():  # in order: research, then opt-in
        env_before = dict(os.environ)
        cache_before = jax.config.jax_compilation_cache_dir
        malloc_tuned.clear()
        args = dict(max_num_seqs=2, num_kv_blocks=16, block_size=8, enforce_eager=True,
                    show_progress=False, **opt_in)
        engine = LLMEngine.from_params(cfg, params, **args)
        engine.close()
        (out,) = jaxpaged.generate([[1, 2, 3]], jaxpaged.SamplingParams(max_tokens=2),
                                   params=params, config=cfg, **args)
        assert len(out.outputs[0].token_ids) == 2
        results[case] = {
            "env_changed": {k: os.environ.get(k) for k in set(env_before) | set(os.environ)
                            if env_before.get(k) != os.environ.get(k)},
            "cache_before": cache_before,
            "cache_after": jax.config.jax_compilation_cache_dir,
            "default_cache": default_cache,
            "malloc_tuned": list(malloc_tuned),
        }
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> dict[str, dict]:
    """What each case's engines changed in the one process: "research" (no opt-in), then
    "opt_in" (configure_process and a compile cache folder)."""
    tmp_path = tmp_path_factory.mktemp("settings")
    cases = {
        "research": {},
        "opt_in": {"configure_process": True, "compile_cache_dir": str(tmp_path / "compiled")},
    }
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "XLA_PYTHON_CLIENT",
                                "JAXPAGED_COMPILE_CACHE", "JAXPAGED_MALLOC"))}  # fmt: skip
    env.update(JAX_PLATFORMS="cpu", JAXPAGED_COMPILE_CACHE=str(tmp_path / "default"))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "tmp_path": str(tmp_path)}


def test_research_code_leaves_the_process_alone(settings):
    got = settings["research"]
    assert got["env_changed"] == {}
    assert got["cache_before"] is None and got["cache_after"] is None
    assert got["malloc_tuned"] == []
    # what serve and generate would pick
    assert got["default_cache"] == os.path.join(settings["tmp_path"], "default")


def test_the_opt_in_configures_the_process(settings):
    cache = os.path.join(settings["tmp_path"], "compiled")
    got = settings["opt_in"]
    assert got["env_changed"] == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.900",
    }
    assert got["cache_before"] is None and got["cache_after"] == cache
    if sys.platform.startswith("linux"):  # glibc: the settings apply
        assert got["malloc_tuned"] and all(got["malloc_tuned"])
