"""Counts XLA compilations, so tests and metrics can prove nothing recompiles while serving;
and JAX's persistent compile cache, for the callers that ask for it."""

from __future__ import annotations

import os
import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Listens to JAX's backend-compile events for as long as it is open.

    JAX's listeners are process-wide, so the count includes compilations made by any code in
    the process while the counter is open; the engine opens one for its own lifetime.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._seconds = 0.0
        self._open = False

    def _on_event(self, event: str, duration_secs: float, **_: object) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self._count += 1
                self._seconds += duration_secs

    def open(self) -> CompileCounter:
        if not self._open:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self._open = True
        return self

    def close(self) -> None:
        if self._open:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
            self._open = False

    def __enter__(self) -> CompileCounter:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._seconds


def default_compile_cache_dir() -> str | None:
    """The persistent compile cache of a command that owns its process (serve, generate): the
    one JAX is configured with already (e.g. ``JAX_COMPILATION_CACHE_DIR``), else
    ``$JAXPAGED_COMPILE_CACHE``, else ``$JAXPAGED_CACHE/xla`` (default
    ``~/.cache/jaxpaged/xla``); None when ``JAXPAGED_COMPILE_CACHE=0``."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    setting = os.environ.get("JAXPAGED_COMPILE_CACHE")
    if setting == "0":
        return None
    if setting:
        return setting
    root = os.environ.get("JAXPAGED_CACHE") or os.path.join("~", ".cache", "jaxpaged")
    return os.path.join(os.path.expanduser(root), "xla")


def enable_persistent_cache(path: str) -> str:
    """Keeps compiled programs in ``path`` (``jax.config``: the whole process), so a restart,
    or another engine with the same shapes, loads them instead of compiling. A folder JAX
    already uses is left as it is. Returns ``path``."""
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path
