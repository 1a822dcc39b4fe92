"""One engine's own compiled programs: closing or dropping the engine releases them and
nobody else's (why: :mod:`jaxpaged.worker.engine_jit`)."""

from __future__ import annotations

from jaxpaged.worker import kv_cache, sampler, step

__all__ = ["EnginePrograms"]


class EnginePrograms:
    """One engine's jitted device functions (the step, the sampler-state row fill, the KV
    pool's creation and block moves). :meth:`close` drops their compiled programs."""

    def __init__(self) -> None:
        self.step = step.step.fresh()
        self.init_state_row = sampler.init_state_row.fresh()
        self.create_pool = kv_cache.create_pool.fresh()
        self.copy_blocks = kv_cache.copy_blocks.fresh()
        self.gather_blocks = kv_cache.gather_blocks.fresh()
        self.scatter_blocks = kv_cache.scatter_blocks.fresh()
        self._names = tuple(vars(self))

    def close(self) -> None:
        """Drops every compiled program (JAX frees a jit's traces and executables with it;
        ``clear_cache`` would also empty a cache shared with other engines' jits). The
        engine cannot run a step afterwards."""
        for name in self._names:
            setattr(self, name, None)
