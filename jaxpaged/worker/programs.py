"""One engine's own compiled programs: closing or dropping the engine releases them and
nobody else's (why: :mod:`jaxpaged.worker.engine_jit`)."""

from __future__ import annotations

from jaxpaged.worker import kv_cache, sampler, step
from jaxpaged.worker.program_store import ProgramStore

__all__ = ["EnginePrograms"]


class EnginePrograms:
    """One engine's jitted device functions (the step, the sampler-state row fill, the KV
    pool's creation and block moves). :meth:`close` drops their compiled programs."""

    def __init__(self, store: ProgramStore | None = None) -> None:
        """``store``: each program is also kept whole there (loaded, not traced, by the
        next process with the same code, shapes and settings)."""
        jits = {
            "step": step.step,
            "init_state_row": sampler.init_state_row,
            "create_pool": kv_cache.create_pool,
            "copy_blocks": kv_cache.copy_blocks,
            "gather_blocks": kv_cache.gather_blocks,
            "scatter_blocks": kv_cache.scatter_blocks,
        }
        for name, shared in jits.items():
            fresh = shared.fresh()
            if store is not None:
                fresh = store.wrap(fresh, name, shared.static_argnames)
            setattr(self, name, fresh)
        self._names = tuple(jits)

    def close(self) -> None:
        """Drops every compiled program (JAX frees a jit's traces and executables with it;
        ``clear_cache`` would also empty a cache shared with other engines' jits). The
        engine cannot run a step afterwards."""
        for name in self._names:
            setattr(self, name, None)
