"""Shared pytest fixtures for the whole suite."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """The suite opts in to the persistent compile cache that serve uses by default (library
    engines leave jax.config alone): reruns load compiled programs instead of compiling. The
    JAX_* variables carry it to the engines the tests start in subprocesses."""
    from jaxpaged.worker.compile_counter import default_compile_cache_dir, enable_persistent_cache

    cache = default_compile_cache_dir()
    if cache is None:
        return
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    enable_persistent_cache(cache)


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    """HF-format folder of the bundled SmolLM2-135M-Instruct (converted once, then cached)."""
    from jaxpaged.models import bundled

    return bundled.default_model_path()
