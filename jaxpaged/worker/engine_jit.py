"""``jax.jit`` whose compiled programs can belong to one engine (see
:mod:`jaxpaged.worker.programs`).

``jax.jit`` keeps a function's compiled executables (and their traces) for as long as the
function lives, keyed by shapes and static arguments. A module-level jitted step therefore
kept every closed engine's programs (its graph definition is a static argument) until the
process ended: each holds machine code in memory mappings of its own, and a process that
built many engines grew until LLVM could not map more.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["engine_jit"]


def engine_jit(fn: Callable[..., Any] | None = None, **jit_options: Any) -> Any:
    """``jax.jit(fn, **jit_options)`` (a shared program for tests and one-off callers) with a
    ``fresh()`` method that makes a new jit of ``fn`` whose cache is its own, and its
    ``static_argnames``. Usable as
    ``@engine_jit`` or ``@engine_jit(static_argnames=...)``."""
    if fn is None:
        return functools.partial(engine_jit, **jit_options)
    shared = jax.jit(fn, **jit_options)

    def fresh() -> Any:
        # a new function object: JAX keys its traces and executables on the function, so
        # they live exactly as long as this jit
        @functools.wraps(fn)
        def program(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return jax.jit(program, **jit_options)

    shared.fresh = fresh
    # the names a caller passes static arguments by (jaxpaged.worker.program_store)
    shared.static_argnames = tuple(jit_options.get("static_argnames", ()))
    return shared
