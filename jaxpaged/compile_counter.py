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
