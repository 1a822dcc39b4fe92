"""Counts XLA compilations, so tests and metrics can prove nothing recompiles while serving."""

from __future__ import annotations

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


def enable_persistent_cache(path: str | None = None) -> str | None:
    """Keeps compiled step programs on disk so a restart (or another engine with the same shapes)
    loads them instead of compiling: ``$JAXPAGED_COMPILE_CACHE``, else
    ``$JAXPAGED_CACHE/xla`` (default ``~/.cache/jaxpaged/xla``); ``JAXPAGED_COMPILE_CACHE=0``
    turns it off. A cache the user configured in JAX already is left alone. Returns the folder
    in use, or None."""
    import os

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    setting = os.environ.get("JAXPAGED_COMPILE_CACHE", path)
    if setting == "0":
        return None
    if not setting:
        root = os.environ.get("JAXPAGED_CACHE") or os.path.join("~", ".cache", "jaxpaged")
        setting = os.path.join(os.path.expanduser(root), "xla")
    jax.config.update("jax_compilation_cache_dir", setting)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return setting
