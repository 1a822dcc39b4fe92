"""Shared pytest fixtures for the whole suite."""

from __future__ import annotations

import gc
import os
import sys

import pytest

from jaxpaged.cli.checkout_path import drop_checkout_root

# helpers shared by the test folders (tiny_llama, simulated_devices); appended, so that the
# folders here (engine, models, serving, ...) shadow no package of the same name
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

# `python -m pytest` (and xdist's workers) put the checkout root first on sys.path, where
# kernels/ (jaxpaged.kernels) shadows the `kernels` distribution transformers >= 5.25 imports.
# PYTHONSAFEPATH keeps it out of the `python -m` / `-c` children the tests start from the root;
# the bench scripts, which import their siblings, are started with tests/bench_env.py's environment
drop_checkout_root(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["PYTHONSAFEPATH"] = "1"


# The modules that take longest on a cold cache (seconds from a `make test` run of
# 2026-12-03, --durations, subprocesses included), longest first. `make test` hands whole
# files to its two workers in collection order (--no-loadscope-reorder; xdist's own order is
# by number of tests, which sent these few-test, long modules last and left one worker idle
# at the end), so they start first and the short modules fill in around them.
LONGEST_FIRST = (
    "tests/engine/test_llm_e2e.py",  # 164
    "tests/parallel/test_parallel.py",  # 155: one subprocess on 4 simulated devices
    "tests/bench/test_bench_smoke.py",  # 92
    "tests/serving/test_ray_serve.py",  # 80
    "tests/engine/test_lora_families.py",  # 59
    "tests/serving/test_real_model.py",  # 50
    "tests/engine/test_spec_grammar_device.py",  # 46
    "tests/models/test_granite.py",  # 44
    "tests/quant/test_family_quant.py",  # 44
    "tests/test_generate_cli.py",  # 40
    "tests/serving/test_agent_apis_real.py",  # 38
    "tests/engine/test_spec_eagle3.py",  # 35
    "tests/engine/test_engine_release.py",  # 33
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_configure(config: pytest.Config) -> None:
    """The suite opts in to the persistent compile cache that serve uses by default (library
    engines leave jax.config alone): reruns load compiled programs instead of compiling. The
    JAX_* variables carry it to the engines the tests start in subprocesses.

    Every program is kept, however fast it compiled: each engine jits its own programs (they
    go when it closes), so a module's engines of equal shapes share them through this cache;
    the short ones too (block moves, the sampler row fill) saved ~30% of a cold run of
    test_generator + test_weights_sleep (133 s -> 94 s).

    The suite's XLA programs are compiled at LLVM's cheapest optimization level (set before
    JAX starts, and inherited by the subprocesses the tests start): the tests check results,
    not the machine code's speed, and a cold compile of tests/models/test_gemma.py +
    test_gpt.py took 33 s against 41 s. bench/ measures speed at XLA's default level; the
    native CPU kernels are compiled by their own build either way."""
    _one_torch_thread()
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    import jax

    from jaxpaged.worker.compile_counter import default_compile_cache_dir, enable_persistent_cache

    cache = default_compile_cache_dir()
    if cache is None:
        return
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    enable_persistent_cache(cache)
    min_secs = float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)


def _one_torch_thread() -> None:
    """transformers' references run torch on one thread: its OpenMP workers spin while they
    wait, and beside another worker's XLA on 2 cores an 8-token greedy generate of a tiny
    model took 0.58 CPU s on 2 threads against 0.03 s on one."""
    import torch

    torch.set_num_threads(1)


_COMPILE_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace",
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With ``JAXPAGED_TEST_COMPILE_LOG=FILE``: appends, per test (its setup, call and
    teardown, so a module fixture counts at the test that builds it), the CPU seconds of this
    process and those JAX spent compiling and tracing, and the number of XLA compiles
    (subprocesses not counted), then its wall-clock start and end (Unix seconds) and the xdist
    worker that ran it: where a cold suite's time goes, and how evenly the workers share it
    (docs/development.md)."""
    path = os.environ.get("JAXPAGED_TEST_COMPILE_LOG")
    if not path:
        yield
        return
    import time

    import jax

    spent = {"compile": 0.0, "trace": 0.0, "compiles": 0}

    def listener(event: str, seconds: float, **_: object) -> None:
        kind = _COMPILE_EVENTS.get(event)
        if kind is not None:
            spent[kind] += seconds
            spent["compiles"] += kind == "compile"

    jax.monitoring.register_event_duration_secs_listener(listener)
    cpu, started = time.process_time(), time.time()
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        with open(path, "a") as f:
            f.write(
                f"{item.nodeid}\t{time.process_time() - cpu:.2f}\t{spent['compile']:.2f}\t"
                f"{spent['trace']:.2f}\t{spent['compiles']}\t{started:.1f}\t{time.time():.1f}\t"
                f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\n"
            )


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    """HF-format folder of the bundled SmolLM2-135M-Instruct (converted once, then cached)."""
    from jaxpaged.models import bundled

    return bundled.default_model_path()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs_between_modules():
    """Each test module's engines and compiled programs are dropped when it ends (no fixture
    outlives a module but the bundled model's path). Without it one pytest process for the
    suite held 5.9 GB after tests/engine and tests/models (3.7 GB at test_llama, 2.0 GB with
    it); the persistent compile cache makes the recompiles of a later module cheap."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()
